"""Host time of building a padded step's inputs (`StaticStepRunner.prepare`, what a CUDA decode
step runs on the host before its graph), this tree beside another, taking turns. Decode steps
of 1, 16 and 64 requests at `--context` tokens (600 by default), a server's 8,192-token model length, with
the Triton backend's full-width block tables (CUDA's default) and the torch backend's bucketed
ones. Runs on the CPU: the inputs are built on the host either way. Prints JSON: ms per call,
the fastest of `--rounds` rounds of 200 calls.

    python -m benchmarks.experiments.padded_prepare [--baseline 717fcd3]

Figures: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


BATCHES = (1, 16, 64)
CONTEXT = 600


def _decoding(context: int, first_block: int):
    request = type("Request", (), {
        "all_token_ids": list(range(context)), "num_computed_tokens": context - 1,
        "draft_token_ids": [], "block_table": list(range(first_block, first_block + 64))})()
    return type("Scheduled", (), {"request": request, "num_fed_tokens": 1, "num_new_tokens": 1,
                                  "samples_token": True})()


def measure(rounds: int, context: int) -> dict[str, float]:
    """ms per prepare, in whichever tree this module is imported from."""
    import torch

    from engine.runner.static_runner import StaticStepRunner

    torch.set_num_threads(1)
    result = {}
    for full in (True, False):
        runner = StaticStepRunner(None, None, 16, scratch_block=100_000, max_num_seqs=256,
                                  max_query_len=1, max_model_len=8192,
                                  device=torch.device("cpu"), use_graphs=False,
                                  full_width_tables=full)
        for batch in BATCHES:
            scheduled = [_decoding(context + i, i * 64) for i in range(batch)]
            for _ in range(20):
                runner.prepare(scheduled)
            best = float("inf")
            for _ in range(rounds):
                started = time.perf_counter()
                for _ in range(200):
                    runner.prepare(scheduled)
                best = min(best, (time.perf_counter() - started) / 200)
            result[f"{'full_width' if full else 'bucketed'}/batch{batch}"] = round(1e3 * best, 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to measure beside this tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens per request")
    parser.add_argument("--turns", type=int, default=3, help="turns each tree takes")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.rounds, args.context)))
        return
    # here, not at the top: the measuring subprocess imports an older tree's `benchmarks`
    from benchmarks.machine import ROOT, baseline_tree, cpu_model

    runs: dict[str, list[dict]] = {}
    with baseline_tree(args.baseline) as baseline:
        trees = {"this": ROOT, **({"baseline": baseline} if baseline else {})}
        for _ in range(args.turns):
            for name, tree in trees.items():
                # the script itself is this tree's; the engine it imports is the tree's own
                out = subprocess.run([sys.executable, __file__, "--measure-only", "--rounds",
                                      str(args.rounds), "--context", str(args.context)],
                                     cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                     check=True, capture_output=True, text=True).stdout
                runs.setdefault(name, []).append(json.loads(out))
    best = {name: {cell: min(run[cell] for run in tree_runs) for cell in tree_runs[0]}
            for name, tree_runs in runs.items()}
    report = {"benchmark": "padded_prepare", "date": time.strftime("%Y-%m-%d"),
              "cpu": cpu_model(), "baseline": args.baseline, "context": args.context,
              "max_model_len": 8192, "ms_per_prepare": best}
    if args.baseline:
        report["baseline_over_this"] = {cell: round(best["baseline"][cell] / best["this"][cell], 2)
                                        for cell in best["this"]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
