"""CPU paged attention by the shape of a step: one layer's call of the default model's attention
(SmolLM2-135M: 9 query heads over 3 KV heads of 64), this tree beside another.

For each shape (requests, rows each, keys each): a decode row, verify steps of 4 and 16 rows, 16
decoding requests, a prefill chunk behind a cached prefix, the fastest of `--rounds` rounds of
`--calls` calls, over shuffled KV blocks. `--baseline REF` checks REF out into a temporary git
worktree and runs this script there as a subprocess, with its own kernel build (its own
SPECSERVE_CACHE_DIR), the trees taking turns `--repeats` times; the medians are reported, and
whether both trees' outputs were bitwise the same (each run hashes its outputs). Prints JSON.
By default a shape's calls repeat one layer's cache, which stays in cache; `--from-memory` cycles
over the model's 30 layers' caches, as a step does, so that long contexts read their keys and
values from memory (a one-row decode at 1,700 keys: 78 MB a step, over twice the L3 of an EPYC).

    python -m benchmarks.experiments.attention_rows [--baseline HEAD~2] [--repeats 3]
        [--from-memory] [--shapes 1x1@1700,16x1@500]

Figures: docs/performance/vs-llamacpp.md (attention in query blocks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((1, 1, 500), (1, 4, 500), (1, 16, 100), (1, 16, 500), (16, 1, 500), (16, 4, 300),
          (1, 70, 400))  # (requests, rows each, keys each)


def format_shapes(shapes) -> str:
    return ",".join(f"{n}x{rows}@{keys}" for n, rows, keys in shapes)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'1x16@1700,1x1@250' -> [(1, 16, 1700), (1, 1, 250)]: the shapes' names in the report."""
    shapes = []
    for item in text.split(","):
        seqs_rows, keys = item.split("@")
        num_seqs, rows = seqs_rows.split("x")
        shapes.append((int(num_seqs), int(rows), int(keys)))
    return shapes


def measure_shape(ops, num_seqs: int, rows_each: int, keys: int, calls: int,
                  rounds: int, layers: int = 1) -> tuple[float, str]:
    """(fastest ms of one call, sha256 of its output). With `layers` > 1 the calls cycle over
    that many caches, as a step goes through its layers: past a few hundred keys a step's keys
    and values then come from memory, not from cache, as they do when serving."""
    import torch

    gen = torch.Generator().manual_seed(num_seqs * 1000 + rows_each * 10 + keys)
    blocks_each = -(-keys // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_each
    caches = [(torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen),
               torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen))
              for _ in range(layers)]
    q = torch.randn(num_seqs * rows_each, NUM_HEADS, HEAD_DIM, generator=gen)
    rest = (torch.arange(num_seqs * rows_each).view(num_seqs, rows_each),
            torch.full((num_seqs,), rows_each), torch.full((num_seqs,), keys),
            torch.randperm(num_blocks, generator=gen).view(num_seqs, blocks_each),
            torch.empty_like(q))
    calls = -(-calls // layers) * layers  # whole passes over the layers
    for layer in range(max(10, layers)):
        ops.paged_attention_small(q, *caches[layer % layers], *rest)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for call in range(calls):
            ops.paged_attention_small(q, *caches[call % layers], *rest)
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3, hashlib.sha256(rest[-1].numpy().tobytes()).hexdigest()


def measure(args) -> dict:
    import torch

    from engine.quant.kernels import load_kernel

    ops = load_kernel()
    query_block = ops.attention_query_block() if hasattr(ops, "attention_query_block") else 1
    shapes = {}
    for num_seqs, rows_each, keys in parse_shapes(args.shapes):
        ms, digest = measure_shape(ops, num_seqs, rows_each, keys, args.calls, args.rounds,
                                   LAYERS if args.from_memory else 1)
        shapes[f"{num_seqs}x{rows_each}@{keys}"] = {"ms_per_layer": round(ms, 4), "sha256": digest}
    return {"threads": torch.get_num_threads(), "query_block": query_block, "shapes": shapes}


def run_tree(tree: Path, cache_dir: str | None, args) -> dict:
    """This script as a subprocess with `tree` first on the import path (and its own kernel
    build where `cache_dir` is given: one build folder serves one tree's sources)."""
    from benchmarks.machine import measure_in_tree

    return measure_in_tree(Path(__file__).resolve(), tree,
                           ["--calls", str(args.calls), "--rounds", str(args.rounds),
                            "--shapes", args.shapes]
                           + (["--from-memory"] if args.from_memory else []),
                           {"SPECSERVE_CACHE_DIR": cache_dir} if cache_dir else None)


def medians(runs: list[dict]) -> dict:
    first = runs[0]
    return {"threads": first["threads"], "query_block": first["query_block"],
            "ms_per_layer": {shape: round(statistics.median(r["shapes"][shape]["ms_per_layer"]
                                                            for r in runs), 4)
                             for shape in first["shapes"]},
            "sha256": {shape: cell["sha256"] for shape, cell in first["shapes"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to measure beside this tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output")
    parser.add_argument("--shapes", default=format_shapes(SHAPES),
                        help="requests x rows each @ keys each, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--from-memory", action="store_true",
                        help=f"cycle over {LAYERS} layers' caches, so that long contexts read "
                             "their keys and values from memory as a real step does")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args)))
        return
    from benchmarks.host_overhead import cpu_isa_flags
    from benchmarks.machine import cpu_model, our_versions, runs_taking_turns

    runs = runs_taking_turns(args.baseline, args.repeats,
                             lambda tree, cache_dir: run_tree(tree, cache_dir, args))
    results = {name: medians(r) for name, r in runs.items()}
    report = {"benchmark": "attention_rows", "cpu": cpu_model(), "cpu_flags": cpu_isa_flags(),
              "versions": our_versions(), "baseline": args.baseline, "repeats": args.repeats,
              "model_shape": {"heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                              "layers": LAYERS},
              "from_memory": args.from_memory, "results": results}
    if args.baseline:
        this, base = results["this"], results["baseline"]
        report["baseline_over_this"] = {shape: round(base["ms_per_layer"][shape] / ms, 3)
                                        for shape, ms in this["ms_per_layer"].items()}
        report["outputs_bitwise_equal"] = this["sha256"] == base["sha256"]
    from specserve.bench.report import emit

    emit(report, args.output, indent=2)


if __name__ == "__main__":
    main()
