"""What an EAGLE-2 draft tree could gain on this machine, before one is built: the head's top-k
hit rates measured while it drafts, and the best tree's speedup they allow at the step costs
measured in the same run.

The engine runs the head as a greedy chain of K drafts (batch 1, the bundled prompts). At every
draft depth d the head's top-k tokens are recorded; the target's tokens (what the step emitted)
say at which rank, if any, the target's token was. Depth d counts only where the chain's drafts
before it were all accepted, so its rates are conditional on a correct path, as a tree's node
below a correct parent is. A tree node at depth d and rank r is then accepted with probability
the product of p_j(r_j) along its path (siblings are disjoint events), and its expected accepted
tokens are the sum over its nodes; the best tree of N nodes takes the N most likely nodes (a
child is never likelier than its parent). Its speedup over plain decoding, in units of a
one-row step s(1):

    (1 + E[accepted]) / (s(1 + N) / s(1) + D * head step / s(1))

with s(n) the step cost fitted over the run's steps and D the tree's depth (sequential head
steps, each priced as one chain step: wider head steps cost more, so this is a bound). The rank
rates assume a node's hit rate depends on its depth and rank, not on its parent's rank.

Figures: docs/speculative-decoding.md (the bound on tree drafts).
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import os
import platform
import sys
import time

import torch

from benchmarks.spec_matrix import method_options
from engine import LLM, SamplingParams
from engine.spec_decode.step_cost import LinearCostModel
from specserve.bench.report import emit
from specserve.bench.workloads import KINDS, encode, load_workloads

TOP_K = 4


class Recorder:
    """Top-k per draft depth from the head, the target's tokens from each step, and timings."""

    def __init__(self, llm: LLM, depth: int):
        self.hits = [[0] * (TOP_K + 1) for _ in range(depth)]
        self.step_fit = LinearCostModel(0.005, 0.001)
        self.draft_seconds, self.draft_steps = 0.0, 0
        self._topk: list[list[int]] = []
        proposer, controller = llm.engine.proposer, llm.engine.controller
        pick, draft, observe = proposer._pick_drafts, proposer._draft, proposer.observe_target_step
        observe_step = controller.observe_step
        plans = [0]

        def planning(requests, max_ks, *args):
            # Every other step drafts K (the deep levels' rates); the others 0..K in turn, so
            # the step-cost fit sees every row count.
            plans[0] += 1
            k = depth if plans[0] % 2 else (plans[0] // 2) % (depth + 1)
            return [min(k, m) for m in max_ks]

        def picking(predicted, requests, drafts_so_far):
            top = eagle_top_k(proposer.head, predicted)
            self._topk.append(top[0])
            return pick(predicted, requests, drafts_so_far)

        def drafting(*args):
            started = time.perf_counter()
            draft(*args)
            self.draft_seconds += time.perf_counter() - started
            self.draft_steps += proposer.num_sequential_steps

        def observing(scheduled, row_starts, hidden, emitted):
            if self._topk and emitted:
                self._score(emitted[0])
            self._topk = []
            observe(scheduled, row_starts, hidden, emitted)

        proposer._pick_drafts, proposer._draft, controller.plan = picking, drafting, planning
        proposer.observe_target_step = observing
        controller.observe_step = lambda n, row_keys, request_keys, s: (
            self.step_fit.observe(n, s), observe_step(n, row_keys, request_keys, s))

    def _score(self, emitted: list[int]) -> None:
        """Depth d is scored where drafts 1..d-1 were accepted: emitted[d-1] is then the
        target's token after a correct path."""
        for depth, top in enumerate(self._topk):
            if depth >= len(emitted):
                break
            rank = top.index(emitted[depth]) if emitted[depth] in top else TOP_K
            self.hits[depth][rank] += 1
            if emitted[depth] != top[0]:
                break  # the chain drafted top[0]; past a rejection the path is not the target's


def eagle_top_k(head, predicted: torch.Tensor) -> list[list[int]]:
    logits = head.draft_logits(predicted)
    return head.token_ids[logits.topk(TOP_K, dim=-1).indices].tolist()


def rank_rates(hits: list[list[int]]) -> list[list[float]]:
    """p[d][r]: the target's token is the head's rank-r token at depth d, given a correct path."""
    return [[count / max(sum(row), 1) for count in row[:TOP_K]] for row in hits]


def best_tree(rates: list[list[float]], num_nodes: int) -> tuple[float, int]:
    """(expected accepted tokens, depth) of the tree of the `num_nodes` likeliest nodes."""
    frontier = [(-rates[0][r], 0, r) for r in range(TOP_K)]  # (-P(path), depth, rank)
    heapq.heapify(frontier)
    expected, depth = 0.0, 0
    for _ in range(num_nodes):
        if not frontier:
            break
        neg_p, d, _rank = heapq.heappop(frontier)
        expected += -neg_p
        depth = max(depth, d + 1)
        if d + 1 < len(rates):
            for r in range(TOP_K):
                heapq.heappush(frontier, (neg_p * rates[d + 1][r], d + 1, r))
    return expected, depth


def bound(rates, step_fit: LinearCostModel, head_step: float, max_nodes: int) -> list[dict]:
    """The best tree of 0..max_nodes nodes: its expected accepted tokens and speedup bound."""
    one = step_fit(1)
    rows = []
    for n in range(0, max_nodes + 1):
        expected, depth = best_tree(rates, n) if n else (0.0, 0)
        cost = step_fit(1 + n) / one + depth * head_step / one
        rows.append({"nodes": n, "depth": depth, "expected_accepted": round(expected, 3),
                     "speedup_bound": round((1 + expected) / cost, 3)})
    return rows


def best_chain(rates, k: int, step_fit: LinearCostModel, head_step: float) -> dict:
    """The chain of K top-1 drafts at the same prices, for comparison with the trees."""
    expected, p = 0.0, 1.0
    for depth in range(k):
        p *= rates[depth][0]
        expected += p
    cost = step_fit(1 + k) / step_fit(1) + k * head_step / step_fit(1)
    return {"k": k, "expected_accepted": round(expected, 3),
            "speedup_bound": round((1 + expected) / cost, 3)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=",".join(KINDS))
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=4, help="the chain's K: the deepest level scored")
    p.add_argument("--max-nodes", type=int, default=10)
    p.add_argument("--draft-head", default=None, help="default: the shipped head")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    options = method_options("eagle-head", None)
    if args.draft_head:
        options["draft_head"] = args.draft_head
    report = {"benchmark": "eagle_tree_bound",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch_threads": torch.get_num_threads(),
              "load_average": [round(v, 2) for v in os.getloadavg()], "workloads": {}}
    for kind in args.workload.split(","):
        # A fresh engine per workload: its step-cost fit and timings are this workload's.
        llm = LLM(adaptive=False, num_speculative_tokens=args.depth,
                  enable_prefix_caching=False, **options)
        prompts = [encode(llm.tokenizer, w) for w in load_workloads(kind, args.num_prompts)]
        llm.generate(prompts[0], SamplingParams(max_tokens=16, temperature=0))  # warm-up
        recorder = Recorder(llm, args.depth)
        for prompt in prompts:
            llm.generate(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                ignore_eos=True))
        rates = rank_rates(recorder.hits)
        head_step = recorder.draft_seconds / max(recorder.draft_steps, 1)
        rows = bound(rates, recorder.step_fit, head_step, args.max_nodes)
        chain = [best_chain(rates, k, recorder.step_fit, head_step) for k in range(1, args.depth + 1)]
        report["workloads"][kind] = {
            "positions_scored": [sum(h) for h in recorder.hits],
            "rank_rates": [[round(v, 3) for v in row] for row in rates],
            "step_ms": {"fixed": round(recorder.step_fit.fixed * 1e3, 3),
                        "per_row": round(recorder.step_fit.per_unit * 1e3, 3)},
            "head_step_ms": round(head_step * 1e3, 3),
            "chains": chain, "trees": rows,
            "best": max(rows, key=lambda r: r["speedup_bound"]),
        }
        best = report["workloads"][kind]["best"]
        print(f"[{kind}] top-1..{TOP_K} at depth 1: {[round(v, 2) for v in rates[0]]}; best tree "
              f"{best['nodes']} nodes, depth {best['depth']}: bound {best['speedup_bound']}x",
              file=sys.stderr, flush=True)
    emit(report, args.output, indent=1)
    return report


if __name__ == "__main__":
    main()
