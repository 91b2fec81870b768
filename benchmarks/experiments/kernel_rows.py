"""The GGUF CPU kernels against torch's float32 matmul, per number of activation rows.

For each row count, y = x W^T with W one of the default model's MLP shapes (1536 x 576) in a
block format, cycled over enough distinct matrices that the weights come from memory as in a real
step, against torch.mm on the same matrices dequantized to float32 (what `--quantization none`
runs). For Q4_1 and Q8_0, also the integer kernel (--quantization gguf: int8 activations, the
weights repacked in 16-row groups, the variant named) and its cost relative to one row. Single
thread by default: the question is the kernel's arithmetic, not the thread pool. Prints JSON:
microseconds per call and multiply-adds per second.

    python -m benchmarks.experiments.kernel_rows [--format Q4_1] [--threads 1] [--rows 1,2,4,8,16,32,64]
        [--int8-variants avx512-vnni,amx-int8]

With --int8-variants, each named integer variant is also timed on the same matrices in the same
run (microseconds per call, and each one's cost relative to its own one-row call).

Figures: docs/performance/vs-llamacpp.md (kernel time by rows).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.quant import formats, int8
from engine.quant.kernels import load_kernel

def seconds_per_call(call, matrices, repeats: int) -> float:
    for w in matrices:  # warm-up
        call(w)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for w in matrices:
            call(w)
        best = min(best, (time.perf_counter() - started) / len(matrices))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="Q4_1", choices=sorted(formats.FORMATS_BY_NAME))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--matrices", type=int, default=40, help="distinct weights cycled")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--int8-variants", default="",
                        help="integer variants to time side by side, e.g. avx512-vnni,amx-int8")
    args = parser.parse_args()
    kernel = load_kernel()
    if kernel is None:
        raise SystemExit("the GGUF kernel could not be built here")
    torch.set_num_threads(args.threads)
    fmt = formats.FORMATS_BY_NAME[args.format]
    M, K = args.out_features, args.in_features
    packed = [formats.random_blocks(fmt, M, K, seed) for seed in range(args.matrices)]
    dense = [kernel.dequantize(w, fmt.ggml_type, K) for w in packed]
    int_type = int8.REPACKED.get(fmt.ggml_type)
    repacked = [int8.repack(w, fmt.ggml_type) for w in packed] if int_type else None
    variant_names = ["generic", "avx2", "avx-vnni", "avx512-vnni", "amx-int8"]
    variants = [v for v in args.int8_variants.split(",") if v] if int_type else []
    results, int8_one_row, variant_one_row = [], None, {}
    for n in (int(r) for r in args.rows.split(",")):
        x, out = torch.randn(n, K), torch.empty(n, M)
        ours = seconds_per_call(lambda w: kernel.matmul_out(x, w, fmt.ggml_type, out), packed,
                                args.repeats)
        theirs = seconds_per_call(lambda w: torch.mm(x, w.t(), out=out), dense, args.repeats)
        results.append({
            "rows": n,
            "gguf_us": round(ours * 1e6, 1),
            "float32_mm_us": round(theirs * 1e6, 1),
            "gguf_gmac_per_s": round(n * M * K / ours / 1e9, 2),
            "float32_mm_gmac_per_s": round(n * M * K / theirs / 1e9, 2),
            "speedup": round(theirs / ours, 2),
        })
        if repacked is not None:
            integer = seconds_per_call(lambda w: kernel.matmul_out(x, w, int_type, out), repacked,
                                       args.repeats)
            int8_one_row = int8_one_row or integer
            results[-1].update({"int8_us": round(integer * 1e6, 1),
                                "int8_gmac_per_s": round(n * M * K / integer / 1e9, 2),
                                "int8_vs_its_one_row": round(integer / int8_one_row, 2)})
        for name in variants:
            isa = variant_names.index(name)
            seconds = seconds_per_call(
                lambda w: kernel.int8_matmul_out(x, w, int_type, out, isa), repacked, args.repeats)
            variant_one_row.setdefault(name, seconds)
            results[-1][f"{name}_us"] = round(seconds * 1e6, 1)
            results[-1][f"{name}_vs_its_one_row"] = round(seconds / variant_one_row[name], 2)
    print(json.dumps({"benchmark": "kernel_rows", "format": fmt.name, "shape": [M, K],
                      "threads": args.threads, "isa": kernel.best_isa(),
                      "int8_variant": kernel.int8_isa() if repacked else None,
                      "results": results},
                     indent=2))


if __name__ == "__main__":
    main()
