"""Where a batch-1 decode step's time goes: matmul kernels vs everything else.

Decodes greedily after a short prompt (speculation off), 16 and 16 + `--max-tokens` tokens; the
difference over `--max-tokens` is one decode step, prefill excluded. With native GGUF weights the
kernel clocks its own matmul calls (inside the fused layers too), so the split is measured in the
same run; with `--quantization none` the float projections are replayed through their Linear
modules on one activation row, `--repeats` times, in a separate pass. Prints JSON.

    python -m benchmarks.experiments.step_breakdown [--quantization gguf|none] [--max-tokens 64]

Figures: docs/models.md and docs/performance/vs-llamacpp.md (where a batch-1 step goes on CPU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine import LLM, SamplingParams
from engine.models.layers import Linear
from engine.quant.kernels import load_kernel

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def matmul_ms_per_step(model, repeats: int) -> float:
    """One decode step's projections and LM head, replayed on one activation row."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(1, _in_features(m)) for m in linears]
    for linear, x in zip(linears, inputs):  # warm-up
        linear(x)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for linear, x in zip(linears, inputs):
            linear(x)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def _in_features(linear: Linear) -> int:
    if linear.gguf is not None:
        return linear.gguf.in_features
    return linear.in_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(speculative_method="none", quantization=args.quantization,
              enable_prefix_caching=False)
    short = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=16 + args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], long)  # warm-up

    kernel = load_kernel() if args.quantization == "gguf" else None

    def seconds(params) -> tuple[float, float]:  # wall, in the kernel's matmuls
        before = kernel.matmul_time()[1] if kernel else 0.0
        started = time.perf_counter()
        llm.generate([PROMPT], params)
        return time.perf_counter() - started, (kernel.matmul_time()[1] if kernel else 0.0) - before

    runs = []
    for _ in range(3):
        (long_wall, long_mm), (short_wall, short_mm) = seconds(long), seconds(short)
        runs.append(((long_wall - short_wall) / args.max_tokens * 1e3,
                     (long_mm - short_mm) / args.max_tokens * 1e3))
    step, matmul = min(runs)  # the quietest run
    if kernel is None:
        matmul = matmul_ms_per_step(llm.engine.runner.model, args.repeats)
    print(json.dumps({
        "quantization": args.quantization,
        "decode_ms_per_token": round(step, 2),
        "tokens_per_s": round(1e3 / step, 1),
        "matmul_ms_per_step": round(matmul, 2),
        "outside_matmul_ms_per_step": round(step - matmul, 2),
        "torch_threads": torch.get_num_threads(),
        "matmul_measured": "kernel clock, same run" if kernel else
                           "float projections replayed through Linear, separate pass",
    }, indent=2))


if __name__ == "__main__":
    main()
