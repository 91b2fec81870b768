"""A batch-1 decode step's decoder layers by context length, this tree beside another: what a
token costs as the KV cache a step reads grows (46 KB a token for the default model, so from
a few hundred tokens on it is read from memory, not from cache).

For each context C: `--requests` requests of C distinct prompt tokens, each decoding
`--max-tokens` greedy tokens through `LLM.generate` (the engine's own steps, its own KV cache
written as serving writes it); the median over their one-row steps of the decoder layers' time
(`hidden_states`, the LM head left out). `--baseline REF` checks REF out into a temporary git
worktree and runs this script there with its own kernel build, the trees taking turns
`--repeats` times; medians of the runs are reported. Prints JSON.

    python -m benchmarks.experiments.decode_context [--baseline ce17b59] [--contexts 100,1700]

Figures: docs/performance/cpu-attention.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONTEXTS = (100, 300, 600, 1000, 1700)


def measure(contexts: list[int], requests: int, max_tokens: int) -> dict:
    from engine import LLM, SamplingParams
    from engine.models import llama

    model_class = llama.LlamaForCausalLM
    original = model_class.hidden_states
    step_ms: list[float] = []

    def timed(self, input_ids, *args, **kwargs):
        started = time.perf_counter()
        hidden = original(self, input_ids, *args, **kwargs)
        if input_ids.shape[0] == 1:  # a one-row decode step (prompts are longer)
            step_ms.append((time.perf_counter() - started) * 1e3)
        return hidden

    model_class.hidden_states = timed
    llm = LLM(speculative_method="none")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    medians = {}
    for context in contexts:
        step_ms.clear()
        for i in range(requests):  # distinct prompts: no prefix-cache hits between them
            first = 1000 + i * 7
            llm.generate([list(range(first, first + context))], params)
        medians[str(context)] = round(statistics.median(step_ms), 3)
    return {"decode_step_ms": medians}


def run_tree(tree: Path, cache_dir: str | None, args) -> dict:
    from benchmarks.machine import measure_in_tree

    return measure_in_tree(Path(__file__).resolve(), tree,
                           ["--contexts", args.contexts, "--requests", str(args.requests),
                            "--max-tokens", str(args.max_tokens)],
                           {"SPECSERVE_CACHE_DIR": cache_dir} if cache_dir else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to measure beside this tree")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.measure_only:
        print(json.dumps(measure(contexts, args.requests, args.max_tokens)))
        return
    from benchmarks.host_overhead import cpu_isa_flags
    from benchmarks.machine import cpu_model, our_versions, runs_taking_turns

    runs = runs_taking_turns(args.baseline, args.repeats,
                             lambda tree, cache_dir: run_tree(tree, cache_dir, args))
    results = {name: {c: round(statistics.median(r["decode_step_ms"][c] for r in tree_runs), 3)
                      for c in map(str, contexts)}
               for name, tree_runs in runs.items()}
    report = {"benchmark": "decode_context", "cpu": cpu_model(), "cpu_flags": cpu_isa_flags(),
              "versions": our_versions(), "baseline": args.baseline, "repeats": args.repeats,
              "requests": args.requests, "max_tokens": args.max_tokens,
              "decode_step_ms": results, "runs": runs}
    if args.baseline:
        report["baseline_over_this"] = {c: round(results["baseline"][c] / ms, 3)
                                        for c, ms in results["this"].items()}
    from specserve.bench.report import emit

    emit(report, args.output, indent=2)


if __name__ == "__main__":
    main()
