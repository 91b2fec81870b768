"""How fast a batch-1 decode step's matmul kernels read the weights, against this machine's read
bandwidth measured the same way with the same threads.

1. Read bandwidth: torch sums a buffer of the model's weight size (where the model itself would
   sit: in L3 on a CPU whose cache holds it) and one of 1 GiB (main memory), best of 10.
2. The step: greedy decoding at batch 1 (speculation off); the kernel clocks its own calls, so
   weights read per step (every packed projection and the LM head, once) over the kernels' time
   per step is the rate one-row calls reach. Prints JSON.

    python -m benchmarks.experiments.weight_bandwidth [--max-tokens 128]

Figures: docs/performance/vs-llamacpp.md (weight streaming bandwidth).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.machine import cpu_model
from engine import LLM, SamplingParams
from engine.quant.kernels import load_kernel

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def read_gb_per_s(num_bytes: int, repeats: int = 10) -> float:
    buffer = torch.ones(num_bytes // 8, dtype=torch.int64)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(repeats))
    return num_bytes / best / 1e9


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(speculative_method="none", quantization="gguf", enable_prefix_caching=False)
    kernel = load_kernel()
    weight_bytes = llm.engine.runner.model.gguf_bytes()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up
    per_step = []
    for _ in range(3):
        calls, seconds = kernel.matmul_time()
        llm.generate([PROMPT], params)
        per_step.append((kernel.matmul_time()[1] - seconds) / args.max_tokens)
    kernel_seconds = min(per_step)  # the quietest run (its prefill step is included, ~1/128)
    in_cache, in_memory = read_gb_per_s(weight_bytes), read_gb_per_s(1 << 30)
    step_rate = weight_bytes / kernel_seconds / 1e9
    print(json.dumps({
        "cpu": cpu_model(), "threads": torch.get_num_threads(),
        "int8_variant": kernel.int8_isa(),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "kernel_ms_per_step": round(kernel_seconds * 1e3, 3),
        "step_weights_gb_per_s": round(step_rate, 1),
        "read_gb_per_s_weight_sized_buffer": round(in_cache, 1),
        "read_gb_per_s_1gib_buffer": round(in_memory, 1),
        "step_over_weight_sized_read": round(step_rate / in_cache, 3),
        "step_over_1gib_read": round(step_rate / in_memory, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
