"""Our engine's raw speed against llama-bench's, per thread count, on the same GGUF file: prompt
processing (tokens/s over a P-token prompt) and decoding (tokens/s over N tokens from a short
context), as llama-bench defines its pp and tg tests. Each thread count runs in its own process
(OMP_NUM_THREADS), ours and llama-bench's in turn, best of --repeats. Prints JSON.

    python -m benchmarks.experiments.vs_llama_bench --llama-bench .llama-server/build/bin/llama-bench
        [--threads 1,2] [--prompt 128] [--decode 128] [--repeats 3] [--quantization gguf]
benchmarks/build_llama_server.sh builds llama-server; `cmake --build .llama-server/build
--target llama-bench` then builds llama-bench beside it in seconds.

Figures: README.md's headline table and docs/performance/vs-llamacpp.md (the engine alone against llama-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date

from benchmarks.machine import cpu_model
from specserve.bench.report import emit


def ours(quantization: str, prompt: int, decode: int, repeats: int) -> dict:
    """This process's rates (its OMP_NUM_THREADS set by the caller)."""
    import engine  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads)
    from engine import LLM, SamplingParams

    llm = LLM(quantization=quantization, speculative_method="none", enable_prefix_caching=False,
              kv_cache_memory_gib=1)
    ids = [(7 * i + 11) % 20000 + 100 for i in range(prompt)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True)

    def seconds(token_ids, params) -> float:
        started = time.perf_counter()
        llm.generate([token_ids], params)
        return time.perf_counter() - started

    seconds(ids[:16], one)  # warm-up
    pp = min(seconds(ids, one) for _ in range(repeats))
    # tg: the decode steps after a one-token prompt's first step
    tg = min(seconds(ids[:1], many) - seconds(ids[:1], one) for _ in range(repeats))
    kernel_variant = None
    from engine.quant.kernels import load_kernel

    if (kernel := load_kernel()) is not None:
        kernel_variant = kernel.int8_isa()
    return {"prompt_tok_s": round(prompt / pp, 1), "decode_tok_s": round(decode / tg, 1),
            "int8_variant": kernel_variant}


def llama_bench(binary: str, threads: int, prompt: int, decode: int, repeats: int,
                model: str) -> dict:
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n",
                          str(decode), "-r", str(repeats), "-o", "json"], capture_output=True,
                         text=True, check=True).stdout
    rates = {("prompt" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.loads(out)}
    return {"prompt_tok_s": round(rates["prompt"], 1), "decode_tok_s": round(rates["decode"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--output")
    parser.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours_only:
        print(json.dumps(ours(args.quantization, args.prompt, args.decode, args.repeats)))
        return
    from engine.models.loader import default_model_path

    model = str(default_model_path())
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        child = subprocess.run([sys.executable, "-m", "benchmarks.experiments.vs_llama_bench", "--ours-only",
                                "--llama-bench", args.llama_bench, "--quantization",
                                args.quantization, "--prompt", str(args.prompt), "--decode",
                                str(args.decode), "--repeats", str(args.repeats)],
                               env=env, capture_output=True, text=True, check=True)
        mine = json.loads(child.stdout.strip().splitlines()[-1])
        theirs = llama_bench(args.llama_bench, threads, args.prompt, args.decode, args.repeats,
                             model)
        results[str(threads)] = {
            "specserve": mine, "llama_bench": theirs,
            "decode_ratio": round(mine["decode_tok_s"] / theirs["decode_tok_s"], 2),
            "prompt_ratio": round(mine["prompt_tok_s"] / theirs["prompt_tok_s"], 2)}
    report = {"benchmark": "vs_llama_bench", "date": date.today().isoformat(),
              "cpu": cpu_model(), "model": model, "quantization": args.quantization,
              "prompt": args.prompt, "decode": args.decode, "results": results}
    emit(report, args.output)


if __name__ == "__main__":
    main()
