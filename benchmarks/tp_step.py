"""Tensor parallelism's step (issue 73, docs/multi-gpu.md): greedy decode of one model at 1 rank
and at N ranks (--tensor-parallel-size), the time per token, the share of rank 0's step spent
inside collectives, and whether the ranks' greedy tokens equal 1 rank's.

    python -m benchmarks.tp_step MODEL|default [--ranks 1,2] [--tokens 64] [--batch 1]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--quantization auto|gguf-exact]
        [--output PATH.json]
    python -m benchmarks.tp_step --write-shape llama3-8b --layers 4 [--tokenizer-from DIR] FOLDER
        # a random-weight folder of the 8B shape cut to 4 of its 32 layers (per-layer costs are
        # the 8B's)

The collectives' share wraps torch.distributed's all_reduce / all_gather on rank 0 with a timer
(on CUDA synchronizing before and after each, so it also counts the wait for the other ranks and
adds syncs the plain step does not have): it bounds what faster collectives could save.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a small village,"]


class CollectiveTimer:
    """Seconds rank 0 spends inside all_reduce / all_gather while installed."""

    def __init__(self, device: torch.device):
        self.seconds, self.calls, self.device = 0.0, 0, device
        self._originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def install(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, original):
        def call(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._sync()
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return call

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(model: str, ranks: int, tokens: int, batch: int, device: str, dtype: str,
            quantization: str, kv_cache_gib: float | None) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(None if model == "default" else model, tensor_parallel_size=ranks, speculative_method="none", device=device,
              dtype=dtype, quantization=quantization,
              kv_cache_memory_gib=kv_cache_gib)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = (PROMPTS * batch)[:batch]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    timer = CollectiveTimer(llm.engine.device)
    timer.install()
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        timer.remove()
        if llm.engine.parallel is not None:
            llm.engine.parallel.close()
    return {"ranks": ranks, "ms_per_step": 1000 * seconds / tokens,
            "collective_share": timer.seconds / seconds if ranks > 1 else 0.0,
            "collectives_per_step": timer.calls / tokens,
            "token_ids": [o.token_ids for o in outputs]}


def write_shape(name: str, layers: int, folder: str, tokenizer_from: str | None) -> None:
    """Random bfloat16 weights of the shape, `layers` of its layers, with the tokenizer files of
    `tokenizer_from` beside them (ids below its vocabulary are ids of the shape's too)."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.real_size import LLAMA3_8B

    shapes = {"llama3-8b": LLAMA3_8B}
    config = AutoConfig.for_model("llama", **{**shapes[name], "num_hidden_layers": layers,
                                               "max_position_embeddings": 2048})
    torch.manual_seed(0)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    for path in Path(tokenizer_from).iterdir() if tokenizer_from else ():
        if path.is_file() and path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto",
                        help="gguf-exact for the token comparison on a GGUF model: int8 "
                             "activations turn the ranks' different summation order into "
                             "different rounding (docs/multi-gpu.md)")
    parser.add_argument("--output")
    parser.add_argument("--write-shape")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokenizer-from", help="for --write-shape: a folder's tokenizer files")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="each rank's KV cache (default: 1 on CPU, from free memory on a "
                             "GPU; give it where ranks share one GPU)")
    args = parser.parse_args()
    if args.write_shape:
        write_shape(args.write_shape, args.layers, args.model, args.tokenizer_from)
        return
    runs = [measure(args.model, int(n), args.tokens, args.batch, args.device, args.dtype,
                    args.quantization,
                    args.kv_cache_gib or (1.0 if args.device == "cpu" else None))
            for n in args.ranks.split(",")]
    from benchmarks.machine import device_facts

    result = {"model": args.model, "machine": device_facts(torch.device(args.device)),
              "device": args.device, "dtype": args.dtype, "quantization": args.quantization,
              "batch": args.batch, "tokens": args.tokens,
              "same_tokens_as_one_rank": [r["token_ids"] == runs[0]["token_ids"] for r in runs],
              "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
