"""The fused decode/verify kernels' tiles, timed on a GPU (engine/models/skinny_gemm.py): each of
a layer's four fused products at the default model's and Llama-3-8B's shapes, candidate tiles at
1 and 8 rows, beside the torch ops each replaces, with the weight bytes a microsecond it streams.

    python -m benchmarks.fused_tiles [--shapes smollm2,llama3-8b] [--rows 1,8] [--quick]

Each candidate's output is checked against the default tiles' within bfloat16's tolerance before
it is timed (CUDA-graph replays, so launch overhead is what a captured step pays). The fastest
per (kind, columns, inner size) is printed as `skinny_tiles.TUNED` entries to paste. Prints JSON;
`--output` writes it too. Under TRITON_INTERPRET=1 on a CPU it runs as a smoke test (tiny
shapes, no timing worth reading).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from engine.models import skinny_gemm
from engine.models.skinny_tiles import Tiles, tiles_for

# (hidden, heads, kv heads, head dim, intermediate)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536), "llama3-8b": (4096, 32, 8, 128, 14336),
          "tiny": (64, 2, 1, 32, 48)}


def candidates(kind: str, half_head: int, quick: bool) -> list[Tiles]:
    widths = [n for n in (16, 32, 64) if kind != "qkv" or n <= half_head]
    steps = [(4, 3)] if quick else [(4, 3), (8, 4)]
    return [Tiles(n, k, warps, stages) for n, k, (warps, stages)
            in itertools.product(widths, (64, 128), steps)]


def products(shape, rows: int, device, dtype):
    """kind -> (weight, fused(tiles), torch path()) for one layer's four products."""
    hidden, heads, kv_heads, head_dim, size = shape
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=g, device=device).to(dtype) * s[-1] ** -0.5
    x, residual, norm = randn(rows, hidden), randn(rows, hidden), torch.ones(hidden, device=device,
                                                                             dtype=dtype)
    qkv, gate_up = randn((heads + 2 * kv_heads) * head_dim, hidden), randn(2 * size, hidden)
    o, down, activated = randn(hidden, heads * head_dim), randn(hidden, size), randn(rows, size)
    attended = randn(rows, heads * head_dim)
    cos, sin = randn(rows, 1, head_dim), randn(rows, 1, head_dim)
    k_cache = torch.zeros(64, 16, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache, slots = torch.zeros_like(k_cache), torch.arange(rows, device=device)

    def torch_qkv():
        y = F.linear(F.rms_norm(x, (hidden,), norm, 1e-5), qkv)
        qk = y[:, :(heads + kv_heads) * head_dim].view(rows, -1, head_dim)
        qk = qk * cos + qk.roll(head_dim // 2, -1) * sin
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, qk[:, heads:])
        return qk

    def torch_gate_up():
        gate, up = F.linear(F.rms_norm(x, (hidden,), norm, 1e-5), gate_up).chunk(2, -1)
        return F.silu(gate) * up

    return {
        "qkv": (qkv, lambda t: skinny_gemm.norm_qkv_rope(
            x, norm, 1e-5, qkv, cos, sin, heads, k_cache, v_cache, slots, t), torch_qkv),
        "gate_up": (gate_up, lambda t: skinny_gemm.norm_gate_up_silu(x, norm, 1e-5, gate_up, t),
                    torch_gate_up),
        "o": (o, lambda t: skinny_gemm.linear(attended, o, residual, t),
              lambda: torch.addmm(residual, attended, o.t())),
        "down": (down, lambda t: skinny_gemm.linear(activated, down, residual, t),
                 lambda: torch.addmm(residual, activated, down.t())),
    }


def microseconds(function, device) -> float | None:
    if device.type != "cuda":
        function()
        return None
    from triton.testing import do_bench_cudagraph

    return round(1e3 * do_bench_cudagraph(function, rep=20), 2)


def table_key(kind: str, weight: torch.Tensor) -> tuple[str, int, int]:
    """The key skinny_tiles.tiles_for looks a product up by."""
    paired = kind in ("qkv", "gate_up")
    return ("linear" if not paired else kind, weight.shape[0] // (2 if paired else 1),
            weight.shape[1])


def measure(shape_name: str, rows_list, quick: bool, device, dtype) -> dict:
    shape = SHAPES[shape_name]
    half = shape[3] // 2
    out = {}
    for rows in rows_list:
        for kind, (weight, fused, reference) in products(shape, rows, device, dtype).items():
            key = table_key(kind, weight)
            default = tiles_for(*key, half)
            expected = fused(default).float()
            cell = out.setdefault(kind, {"key": list(key), "default": vars(default),
                                         "weight_bytes": weight.numel() * weight.element_size(),
                                         "rows": {}})
            timings = {"torch_path_us": microseconds(reference, device), "tiles": []}
            for tiles in candidates(key[0], half, quick):
                agrees = torch.allclose(fused(tiles).float(), expected, atol=2e-2, rtol=2e-2)
                timings["tiles"].append({**vars(tiles), "agrees": agrees,
                                         "us": microseconds(lambda: fused(tiles), device)})
            cell["rows"][str(rows)] = timings
    return out


def best_entries(results: dict) -> list[str]:
    """`TUNED` lines: per product, the agreeing tiles with the least time summed over rows."""
    lines = []
    for shape in results.values():
        for cell in shape.values():
            totals = {}
            for timings in cell["rows"].values():
                for t in timings["tiles"]:
                    if t["agrees"] and t["us"] is not None:
                        tiles = (t["block_n"], t["block_k"], t["num_warps"], t["num_stages"])
                        totals[tiles] = totals.get(tiles, 0.0) + t["us"]
            if totals:
                best = min(totals, key=totals.get)
                lines.append(f"{tuple(cell['key'])!r}: Tiles{best!r},")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2,llama3-8b")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--quick", action="store_true", help="one warps/stages pair")
    parser.add_argument("--output")
    args = parser.parse_args()
    from benchmarks.machine import device_facts
    from engine.core.device import pick_device
    from specserve.bench.report import emit

    device = pick_device(None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [int(r) for r in args.rows.split(",")]
    results = {name: measure(name, rows, args.quick, device, dtype)
               for name in args.shapes.split(",")}
    emit({"benchmark": "fused_tiles", "date": time.strftime("%Y-%m-%d"),
          **device_facts(device), "dtype": str(dtype), "rows": rows, "results": results,
          "tuned_entries": best_entries(results)}, args.output)


if __name__ == "__main__":
    main()
