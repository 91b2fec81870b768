"""Microseconds a suffix proposal costs per engine step at batch 1, the global lookup included.

A request with a long prompt decodes; each step the proposer reads the tokens the last step
appended (1 to K + 1 of them, as acceptance varies), matches them in its own trie and in the
tenant's global trie (filled with finished requests first), and drafts up to K tokens. The
first step (indexing the prompt) is reported apart: it is paid once per request. Each case runs
on the C++ trie and on the pure-Python one (SPECSERVE_DISABLE_SUFFIX_NATIVE=1), taking turns.

    PYTHONPATH=. python benchmarks/suffix_proposal_cost.py --output benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.suffix import build_suffix_proposer
from engine.spec_decode.suffix_native import native_trie_class
from specserve.bench.report import emit


def templated_tokens(rng: random.Random, length: int, vocab: int = 49152) -> list[int]:
    """Text-like tokens: phrases drawn from a small pool, so substrings repeat as in real
    traffic (a uniform draw would never match and would flatter the lookup)."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 9))] for _ in range(300)]
    tokens: list[int] = []
    while len(tokens) < length:
        tokens.extend(rng.choice(phrases))
    return tokens[:length]


def run(prompt_tokens: int, output_tokens: int, cached_requests: int, k: int, seed: int,
        trie: str) -> dict:
    if trie == "python":
        os.environ["SPECSERVE_DISABLE_SUFFIX_NATIVE"] = "1"
    else:
        os.environ.pop("SPECSERVE_DISABLE_SUFFIX_NATIVE", None)
        if native_trie_class() is None:
            raise SystemExit("the C++ suffix trie did not build")
    rng = random.Random(seed)
    proposer = build_suffix_proposer(SpeculativeConfig(speculative_method="suffix"))
    for _ in range(cached_requests):
        done = Request("old", templated_tokens(rng, 64), SamplingParams())
        for token in templated_tokens(rng, output_tokens):
            done.append_output_token(token)
        proposer.request_finished(done)
    stream = templated_tokens(rng, prompt_tokens + output_tokens * 2)
    request = Request("live", stream[:prompt_tokens], SamplingParams())
    position = prompt_tokens
    started = time.perf_counter()
    proposer.propose([request], [k])
    first_step = time.perf_counter() - started
    steps, drafted = [], 0
    while request.num_output_tokens < output_tokens:
        for token in stream[position:position + rng.randrange(1, k + 2)]:
            request.append_output_token(token)
            position += 1
        started = time.perf_counter()
        proposal = proposer.propose([request], [k])
        steps.append(time.perf_counter() - started)
        drafted += len(proposal.draft_token_ids[0])
    steps_us = sorted(s * 1e6 for s in steps)
    return {"trie": trie, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "cached_requests": cached_requests, "k": k, "steps": len(steps),
            "first_step_us": round(first_step * 1e6, 1),
            "step_us_mean": round(statistics.fmean(steps_us), 2),
            "step_us_median": round(steps_us[len(steps_us) // 2], 2),
            "step_us_p90": round(steps_us[int(len(steps_us) * 0.9)], 2),
            "draft_tokens_per_step": round(drafted / len(steps), 2),
            "cache": vars(proposer.cache_stats())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None)
    parser.add_argument("--cpu", default="unnamed", help="the CPU, for the record")
    args = parser.parse_args()
    shapes = [(200, 256, 0, 5), (1000, 256, 100, 5), (4000, 256, 200, 5), (1000, 256, 100, 8),
              (1000, 256, 100, 15), (4000, 256, 200, 15),  # 15: suffix's default K
              (4000, 256, 2000, 15)]
    cases = [run(p, o, c, k, seed=i, trie=trie) for i, (p, o, c, k) in enumerate(shapes)
             for trie in ("cpp", "python")]
    emit({"benchmark": "suffix_proposal_cost", "cpu": args.cpu, "cases": cases}, args.output)


if __name__ == "__main__":
    main()
