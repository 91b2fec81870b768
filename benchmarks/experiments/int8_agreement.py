"""How closely `--quantization gguf` (int8 activations, integer dot products: llama.cpp's
arithmetic) follows `--quantization gguf-exact` (float32 activations on the same GGUF blocks),
teacher-forced on text no one tuned on: the bundled HumanEval prompts with their reference
solutions, and MT-Bench questions. Per position: top-1 agreement of the two models' logits; over
all positions: each one's perplexity. With --llamacpp-python (the Python of a llama-cpp-python
venv, as benchmarks/vs_llamacpp.sh builds it), llama.cpp's own logits on the same file and
tokens too (benchmarks/experiments/llamacpp_logits.py): top-1 agreement of each of ours with it, and its
perplexity.

    python -m benchmarks.experiments.int8_agreement [--positions 5000] [--window 512] [--output FILE.json]
        [--llamacpp-python .venv-llamacpp/bin/python]

Figures: docs/models.md and docs/performance/vs-llamacpp.md (integer arithmetic's agreement with float and llama.cpp).
"""

from __future__ import annotations

import engine  # noqa: F401  # isort: skip  (first: it sets OpenMP's wait policy before torch loads)

import argparse
import json
import math
import subprocess
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.machine import cpu_model
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.loader import default_model_path, load_model
from engine.quant.kernels import load_kernel
from specserve.bench.report import emit
from specserve.bench.workloads import DATA, _read_jsonl

BLOCK_SIZE = 16
CHUNK = 128  # prefill chunk: the engine's own chunked-prefill path


def texts() -> list[str]:
    code = [r["prompt"] + r["canonical_solution"]
            for r in _read_jsonl(DATA / "humaneval_subset.jsonl")]
    chat = [" ".join(r["turns"]) for r in _read_jsonl(DATA / "mt_bench_subset.jsonl")]
    return code + chat


def teacher_forced_logits(model, token_ids: list[int]) -> torch.Tensor:  # [T, vocab]
    cache = KVCache(model.arch, num_blocks=len(token_ids) // BLOCK_SIZE + 2,
                    block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
    table = list(range(cache.num_blocks))
    logits = []
    for start in range(0, len(token_ids), CHUNK):
        end = min(start + CHUNK, len(token_ids))
        meta = build_attention_metadata([end - start], [end], [table], BLOCK_SIZE,
                                        torch.device("cpu"))
        logits.append(model(torch.tensor(token_ids[start:end]), torch.arange(start, end), cache,
                            meta, torch.arange(end - start)))
    return torch.cat(logits)


class Nudged(torch.nn.Module):
    """The model with its input embeddings scaled by (1 + 2^-22): the smallest change there is."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.arch = model, model.arch

    def forward(self, *args, **kwargs):
        original = self.inner.embed
        self.inner.embed = lambda ids: original(ids) * (1 + 2**-22)
        try:
            return self.inner(*args, **kwargs)
        finally:
            del self.inner.embed


def llamacpp_results(python: str, texts_ids: list[list[int]], *options: str) -> list[dict]:
    """llama.cpp's top-1 tokens and summed NLL per text (benchmarks/experiments/llamacpp_logits.py)."""
    script = Path(__file__).with_name("llamacpp_logits.py")
    lines = "".join(json.dumps(ids) + "\n" for ids in texts_ids)
    done = subprocess.run([python, str(script), str(default_model_path()), "--n-ctx",
                           str(max(map(len, texts_ids)) + 16), *options], input=lines,
                          text=True, capture_output=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=5000, help="at least this many")
    parser.add_argument("--window", type=int, default=512, help="most tokens per text")
    parser.add_argument("--output")
    parser.add_argument("--llamacpp-python", help="a llama-cpp-python venv's python")
    args = parser.parse_args(argv)

    cpu = torch.device("cpu")
    models = {q: load_model(None, cpu, torch.float32, quantization=q)
              for q in ("gguf-exact", "gguf")}
    tokenizer = models["gguf"].tokenizer
    # The floor of any agreement figure: each path against itself with its input embeddings
    # scaled by (1 + 2^-22), one or two float32 ulps; nothing else differs.
    for q in ("gguf-exact", "gguf"):
        models[f"{q} +1ulp"] = SimpleNamespace(model=Nudged(models[q].model))
    positions = 0
    texts_ids, top1 = [], {q: [] for q in models}
    nll = {q: 0.0 for q in models}
    for text in texts():
        token_ids = tokenizer(text)["input_ids"][:args.window]
        if len(token_ids) < 2:
            continue
        texts_ids.append(token_ids)
        targets = torch.tensor(token_ids[1:])
        for q, m in models.items():
            values = teacher_forced_logits(m.model, token_ids)[:-1]
            top1[q].append(values.argmax(-1))
            nll[q] += float(torch.nn.functional.cross_entropy(values, targets, reduction="sum"))
        positions += len(targets)
        if positions >= args.positions:
            break
    if args.llamacpp_python:
        results = llamacpp_results(args.llamacpp_python, texts_ids)
        top1["llama.cpp"] = [torch.tensor(r["argmax"]) for r in results]
        nll["llama.cpp"] = sum(r["nll"] for r in results)
        # llama.cpp's default KV cache holds float16; ours float32: the same with float32 too.
        results = llamacpp_results(args.llamacpp_python, texts_ids, "--kv-f32")
        top1["llama.cpp-kv-f32"] = [torch.tensor(r["argmax"]) for r in results]
        nll["llama.cpp-kv-f32"] = sum(r["nll"] for r in results)
    top1 = {q: torch.cat(values) for q, values in top1.items()}
    perplexity = {q: round(math.exp(total / positions), 4) for q, total in nll.items()}
    agreement = {f"{a} vs {b}": round(float((top1[a] == top1[b]).float().mean()), 4)
                 for i, a in enumerate(top1) for b in list(top1)[i + 1:]}
    kernel = load_kernel()
    report = {
        "benchmark": "int8_agreement", "date": date.today().isoformat(), "cpu": cpu_model(),
        "int8_variant": kernel.int8_isa() if kernel is not None else "torch reference",
        "positions": positions, "top1_agreement": agreement, "perplexity": perplexity,
        "perplexity_ratio_gguf_over_exact": round(perplexity["gguf"] / perplexity["gguf-exact"], 4),
    }
    emit(report, args.output)


if __name__ == "__main__":
    main()
