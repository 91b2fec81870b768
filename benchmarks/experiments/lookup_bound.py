"""How fast could any lookup proposer be? Batch-1 bounds for speculation on the agentic workloads.

Issue 46 asks `suffix` for 2x `none` and 1.3x `ngram` on the agent loop and the templates at
batch 1. This measures what the best possible proposer of each kind would reach on the same
turns, through the same engine, on the CPU at hand, beside `none`, `ngram` and `suffix`:

- `oracle-lookup`: drafts, at every step, the longest prefix of the true greedy continuation that
  the text a lookup proposer could have seen holds right after the token before it: every
  earlier turn's prompt and answer in the workload, this prompt, and this answer so far; nothing
  where that prefix is empty. `suffix` and `ngram` only ever draft text they have seen following
  a match of at least one token (a path in a suffix trie is a substring of what it indexed), so
  their accepted tokens per step are at most this, and it wastes no row: its tokens/s bound
  theirs up to its draft ceiling (`--max-k`, 32 by default: the engine's most). A loose bound:
  it knows which of the occurrences to follow, and when to stop.
- `oracle-anywhere`: the same without the token before (the text occurs anywhere at all).
- `oracle-perfect`: drafts the true continuation itself (any proposer, a model included, can at
  best guess right every time).

The oracles' drafts are computed before the clock starts (their lookups cost nothing), they draft
at prefill as `ngram` and `suffix` do, and the engine verifies them as any drafts: every output
is held equal to `none`'s. The truth is `none`'s greedy answer from a first pass (every turn is
sent at T = 0, whatever its workload says; 64 tokens at most, as in benchmarks/agentic.py). Each
method is its own engine in this process; on each turn they take turns (whoever goes first
rotating).

    python -m benchmarks.experiments.lookup_bound [--workloads agent_loop,templated]
        [--methods none,suffix,suffix@num_speculative_tokens=32] [--scale 2] [--rounds 2]
        [--output X.json]

Figures: docs/performance/lookup-bound.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.agentic_run import turn_messages
from benchmarks.agentic_workloads import Workload, all_workloads, select_workloads
from benchmarks.machine import cpu_model, int8_variant, our_versions
from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.spec_decode.proposer import Proposal, Proposer
from specserve.bench.report import emit, taking_turns

MAX_TOKENS = 64
# The lookup oracles' context: `oracle-lookup` continues only where the token before the draft
# precedes the same text somewhere (a suffix or n-gram match of at least one token, as `suffix`
# and `ngram` need); `oracle-anywhere` wherever the text occurs at all.
ORACLE_CONTEXT = {"oracle-lookup": 1, "oracle-anywhere": 0}
NUM_KV_BLOCKS = 1024  # 16,384 tokens a method: every turn's prompt and answer fit


@dataclass
class Turn:
    prompt: str
    prompt_ids: tuple[int, ...]
    answer: list[int]  # none's greedy tokens


def as_text(token_ids: Sequence[int]) -> str:
    """Token ids as one character each, so that `in` finds token substrings (vocabularies are
    far below the code points past the surrogates)."""
    return "".join(chr(0xE000 + t) for t in token_ids)


def lookup_lengths(seen: str, prompt_ids: Sequence[int], answer: list[int],
                   context: int) -> list[int]:
    """Per answer position p: the longest j such that the last `context` tokens before p
    followed by answer[p:p + j] occur in `seen` (earlier turns, as text) + the prompt +
    answer[:p]."""
    lengths, own = [], as_text(prompt_ids)
    for p in range(len(answer)):
        text = seen + "\n" + own + as_text(answer[:p])
        before = (own + as_text(answer[:p]))[-context:] if context else ""
        j = 0
        while p + j < len(answer) and before + as_text(answer[p:p + j + 1]) in text:
            j += 1
        lengths.append(j)
    return lengths


class OracleProposer(Proposer):
    """Drafts the answer of the turn being served (`serve`: one request at a time) from where
    the request stands, cut at the turn's lookup lengths, or not cut (None: the perfect
    proposer)."""

    name = "oracle"
    sits_out_steps = True
    drafts_at_prefill = True

    def __init__(self):
        self.answer: list[int] = []
        self.lengths: list[int] | None = None

    def serve(self, answer: list[int], lengths: list[int] | None) -> None:
        self.answer, self.lengths = answer, lengths

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        drafts = []
        for request, k in zip(requests, num_tokens):
            p = request.num_output_tokens
            if self.lengths is not None:
                k = min(k, self.lengths[p] if p < len(self.lengths) else 0)
            drafts.append(self.answer[p:p + k])
        return Proposal(drafts)


def chat_prompt(tokenizer, workload: Workload, messages: list[dict]) -> str:
    system = [{"role": "system", "content": workload.system}] if workload.system else []
    return tokenizer.apply_chat_template(system + messages, add_generation_prompt=True,
                                         tokenize=False)


def reference_turns(llm: LLM, workload: Workload) -> list[Turn]:
    """`none`'s greedy answers, each turn re-sending its episode's history where it asks."""
    turns = []
    for episode in workload.episodes:
        history = []
        for turn in episode:
            messages = turn_messages(history, turn)
            prompt = chat_prompt(llm.tokenizer, workload, messages)
            out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
            turns.append(Turn(prompt, tuple(out.prompt_token_ids), list(out.token_ids)))
            history = messages + [{"role": "assistant", "content": out.text}]
    return turns


def oracle_lengths(turns: list[Turn], context: int) -> list[list[int]]:
    """Each turn's lookup lengths, every earlier turn seen."""
    lengths, seen = [], ""
    for turn in turns:
        lengths.append(lookup_lengths(seen, turn.prompt_ids, turn.answer, context))
        seen += "\n" + as_text(turn.prompt_ids) + as_text(turn.answer)
    return lengths


def engine_options(method: str) -> tuple[str, dict]:
    """`suffix@num_speculative_tokens=24@suffix_min_token_prob=0.3`: the method and engine
    options (named as LLM's keyword arguments), to compare a method's settings side by side."""
    name, *options = method.split("@")
    parsed = {}
    for option in options:
        key, _, value = option.partition("=")
        parsed[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return name, parsed


def make_engine(method: str, max_k: int) -> LLM:
    """An engine per method; an oracle rides on a fixed-K `ngram` engine's speculation."""
    name, options = engine_options(method)
    if name in ("none", "ngram", "suffix", "auto"):
        return LLM(speculative_method=name, num_kv_blocks=NUM_KV_BLOCKS, **options)
    if method not in ORACLE_CONTEXT and method != "oracle-perfect":
        raise SystemExit(f"unknown method {method!r}")
    llm = LLM(speculative_method="ngram", num_speculative_tokens=max_k, adaptive=False,
              num_kv_blocks=NUM_KV_BLOCKS)
    llm.engine.speculation.proposer = OracleProposer()
    return llm


class StepCount:
    """Engine steps, from the engine's own step reports."""

    def __init__(self):
        self.steps = 0

    def on_step(self, stats) -> None:
        self.steps += 1

    def on_request_finished(self, stats) -> None:
        pass


def run_workload(workloads: list[Workload], methods: list[str], max_k: int,
                 reference: LLM) -> dict:
    """One workload drawn once per round (`workloads`), its turns in order; on each turn the
    methods take turns."""
    turns = [turn for workload in workloads for turn in reference_turns(reference, workload)]
    engines = {m: make_engine(m, max_k) for m in methods}
    lengths = {context: oracle_lengths(turns, context)
               for context in set(ORACLE_CONTEXT.values())}
    counts = {m: StepCount() for m in methods}
    for method, llm in engines.items():
        llm.engine.add_stat_listener(counts[method])
    seconds = {m: 0.0 for m in methods}
    drafted, accepted = {m: 0 for m in methods}, {m: 0 for m in methods}
    identical = True
    for index, turn in enumerate(turns):
        for method in taking_turns(methods, index):
            proposer = engines[method].engine.proposer
            if isinstance(proposer, OracleProposer):
                context = ORACLE_CONTEXT.get(method)
                proposer.serve(turn.answer, None if context is None else lengths[context][index])
            started = time.perf_counter()
            out = engines[method].generate(
                [turn.prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
            seconds[method] += time.perf_counter() - started
            drafted[method] += out.spec_stats.num_draft_tokens
            accepted[method] += out.spec_stats.num_accepted_tokens
            identical &= list(out.token_ids) == turn.answer
    tokens = sum(len(t.answer) for t in turns)
    return {
        "turns": len(turns), "completion_tokens": tokens, "outputs_identical": identical,
        "answer_tokens_a_lookup_could_draft": round(
            sum(1 for turn_lengths in lengths[1] for j in turn_lengths if j) / tokens, 3),
        "methods": {m: {"seconds": round(seconds[m], 3),
                        "tokens_per_s": round(tokens / seconds[m], 1),
                        "steps": counts[m].steps, "draft_tokens": drafted[m],
                        "accepted_tokens": accepted[m]} for m in methods},
        "ratios": {f"{a}_over_{b}": round(seconds[b] / seconds[a], 3)
                   for a in methods if a != "none" for b in methods if b != a},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="agent_loop,templated")
    parser.add_argument("--methods",
                        default="none,ngram,suffix,oracle-lookup,oracle-anywhere,oracle-perfect")
    parser.add_argument("--max-k", type=int, default=32, help="the oracles' draft ceiling")
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2,
                        help="draw the workloads this often (seed, seed + 1, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    reference = LLM(speculative_method="none", num_kv_blocks=NUM_KV_BLOCKS)
    names = args.workloads.split(",")
    rounds = [select_workloads(all_workloads(args.seed + r, args.scale), names)
              for r in range(args.rounds)]
    report = {"benchmark": "lookup_bound", "cpu": cpu_model(), "int8_variant": int8_variant(),
              "versions": our_versions(), "batch": 1, "max_tokens": MAX_TOKENS,
              "oracle_max_k": args.max_k, "scale": args.scale, "rounds": args.rounds,
              "seed": args.seed,
              "workloads": {name: run_workload([r[i] for r in rounds], methods, args.max_k,
                                               reference)
                            for i, name in enumerate(r.name for r in rounds[0])}}
    emit(report, args.output)


if __name__ == "__main__":
    main()
