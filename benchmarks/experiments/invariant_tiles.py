"""Tiles for the row-invariant product (engine/models/invariant_linear.py), timed on a GPU.

`--batch-invariant` ran a Llama-3-8B-shaped step at 2.11x the bandwidth limit on an H200, where
cuBLAS ran it at 1.35x (docs/gpu.md): the default tiles are untuned. For each weight shape of
SmolLM2-135M and Llama-3-8B this times every candidate tiling (columns per program, inner
columns a step, warps, pipeline stages) at 1, 8 and 64 rows beside cuBLAS, checks that each
candidate keeps a row's result independent of the other rows (row 0 alone against row 0 among
16 and 64), and names the fastest invariant one per shape. One device call; prints JSON.

    python -m benchmarks.experiments.invariant_tiles [--models smollm2,llama3-8b] [--output F]

On the CPU, `TRITON_INTERPRET=1 ... --models tiny --candidates 2` runs the same code on a small
shape, untimed in any useful sense (the tests' smoke run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.machine import device_facts
from benchmarks.real_size import timed
from engine.models import invariant_linear
from engine.models.invariant_linear import Tiles

# (name, out_features, in_features) of each product, the LM head last
SHAPES = {
    "smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                ("down", 576, 1536), ("lm_head", 49152, 576)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336), ("lm_head", 128256, 4096)],
    "tiny": [("tiny", 96, 80)],
}
ROWS = (1, 8, 64)


def candidates() -> list[Tiles]:
    return [Tiles(n, k, warps, stages) for n, k, warps, stages
            in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4))]


def row_invariant(weight: torch.Tensor, x: torch.Tensor, tiles: Tiles) -> bool:
    alone = invariant_linear.linear(x[:1], weight, tiles=tiles)
    return all(torch.equal(invariant_linear.linear(x[:rows], weight, tiles=tiles)[:1], alone)
               for rows in (16, 64))


def sweep_shape(out_features: int, in_features: int, tiles_list: list[Tiles], device, dtype,
                iters: int) -> dict:
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator)
              / in_features ** 0.5).to(device, dtype)
    x = torch.randn(max(ROWS), in_features, generator=generator).to(device, dtype)
    cublas = {rows: timed(lambda r=rows: F.linear(x[:r], weight), device, iters)
              for rows in ROWS}
    default = invariant_linear.tiles_for(out_features, in_features)
    results = []
    for tiles in dict.fromkeys([default, *tiles_list]):
        try:
            ms = {rows: 1e3 * timed(
                lambda r=rows: invariant_linear.linear(x[:r], weight, tiles=tiles), device, iters)
                for rows in ROWS}
        except Exception as error:  # a tiling the compiler refuses (shared memory, registers)
            results.append({"tiles": tiles.__dict__, "error": str(error).splitlines()[0][:200]})
            continue
        results.append({"tiles": tiles.__dict__, "ms": ms, "default": tiles == default,
                        "row_invariant": row_invariant(weight, x, tiles)})
    invariant = [r for r in results if "ms" in r and r["row_invariant"]]
    best = min(invariant, key=lambda r: (r["ms"][1], r["ms"][64]), default=None)
    return {"weight_bytes": weight.numel() * weight.element_size(),
            "cublas_ms": {rows: 1e3 * s for rows, s in cublas.items()},
            "best": best, "candidates": results}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,llama3-8b")
    parser.add_argument("--candidates", type=int, default=None, help="the first N only")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiles_list = candidates()[:args.candidates]
    report = {"benchmark": "invariant_tiles", "date": time.strftime("%Y-%m-%d"),
              **device_facts(device), "dtype": str(dtype).removeprefix("torch."),
              "rows": list(ROWS), "shapes": {}}
    for model in args.models.split(","):
        for name, out_features, in_features in SHAPES[model]:
            report["shapes"][f"{model}/{name}"] = sweep_shape(
                out_features, in_features, tiles_list, device, dtype, args.iters)
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
