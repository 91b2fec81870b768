"""Speculation methods side by side on the serving model: batch 1 per workload, then the matrix.

    python -m benchmarks.spec_matrix --output benchmarks/results/spec_matrix.json

Model: the default GGUF on its native kernels (what `make serve` runs), every method with its
adaptive controller on, prefix caching off, EOS ignored. Everything runs in one process, the
methods taking turns on every prompt and every cell, so that machine noise hits them alike;
compare ratios, not absolute numbers.

1. Batch 1 (`--batch1-methods`, at each `--temperatures`): per workload, tokens/s over its
   prompts, the ratio to `none`, acceptance rate, mean acceptance length (tokens per verify step),
   and for greedy runs whether the tokens equal `none`'s.
2. The matrix (`--matrix-methods` x `--concurrency` x workloads, greedy): the workload's prompts
   cycled to c requests in one generate call; tokens/s and the ratio to `none` measured beside it.
   A cell runs `--matrix-max-tokens` (256; on a GPU at least MIN_MATRIX_TOKENS) a request, after
   an untimed pass of `none` and the method at the same batch and prompt lengths (each token id
   shifted by one, so that a suffix cache does not learn the timed outputs): a GPU cell of 32
   tokens at shapes met for the first time measured warm-up, `none` at 64 requests reading
   1,659 and 8,750 tok/s in two runs minutes apart (issue 70). Warm-up seconds are reported
   apart (`warmup_seconds`, per cell and in all).

JSON to stdout and --output; a figure to --plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.machine import device_facts
from benchmarks.spec_matrix_plot import plot
from engine import LLM, SamplingParams
from engine.core.memory import CPU_KV_CACHE_GIB
from engine.metrics.spec_stats import SpecStats
from engine.models.loader import resolve_model_folder
from specserve.bench.offline import build_truncated_draft
from specserve.bench.report import emit, taking_turns
from specserve.bench.workloads import KINDS, encode, load_workloads

METHODS = ("none", "ngram", "suffix", "auto", "eagle", "eagle-head", "layer-skip", "draft")
MIN_MATRIX_TOKENS = 256  # a GPU cell's tokens a request: long enough to be steady state


def method_options(method: str, draft_folder: Path | None) -> dict:
    """Engine options of a benchmark method; eagle-head is eagle without its n-gram lookup.
    `eagle@DIR` and `eagle-head@DIR` use the head in DIR instead of the shipped one.
    `METHOD:overlap` is the method with `--async-scheduling` (quiet steps:
    engine/spec_decode/quiet_steps.py; their default on CUDA), `METHOD:sync` without."""
    method, overlap, _ = method.partition(":overlap")
    if overlap:
        return {**method_options(method, draft_folder), "async_scheduling": True}
    method, sync, _ = method.partition(":sync")
    if sync:
        return {**method_options(method, draft_folder), "async_scheduling": False}
    method, _, head = method.partition("@")
    if head:
        return {**method_options(method, draft_folder), "draft_head": head}
    if method == "eagle-head":
        return {"speculative_method": "eagle", "eagle_ngram_min": 0}
    if method == "draft":
        return {"speculative_method": "draft", "draft_model": str(draft_folder)}
    return {"speculative_method": method}


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params if len(prompts) == 1 else
                           [dataclasses.replace(params, seed=(params.seed or 0) + i)
                            for i in range(len(prompts))])
    return outputs, time.perf_counter() - start


def spec_summary(outputs) -> dict:
    stats = SpecStats()
    for output in outputs:
        if output.spec_stats is not None:
            stats.merge(output.spec_stats)
    return {"num_draft_tokens": stats.num_draft_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4) if stats.num_draft_tokens else None,
            "mean_acceptance_length": (round(stats.mean_acceptance_length, 3)
                                       if stats.num_drafts else None)}


def step_cost_now(llm: LLM) -> dict:
    """The controller's price list as it stands (engine/spec_decode/step_cost.py): why a
    method drafted as little or as much as it did."""
    cost = llm.engine.speculation.controller.step_cost
    return {"fixed": round(cost.fixed * 1e3, 4), "per_row_unit": round(cost.per_unit * 1e3, 4)}


def batch_one(llms: dict[str, LLM], prompts: dict[str, list[list[int]]], max_tokens: int,
              temperature: float) -> dict:
    """results[kind][method]: every prompt alone, the methods taking turns on each."""
    results = {}
    for kind, kind_prompts in prompts.items():
        tokens = {m: 0 for m in llms}
        seconds = {m: 0.0 for m in llms}
        outputs = {m: [] for m in llms}
        for n, prompt in enumerate(kind_prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                    ignore_eos=True, seed=n if temperature > 0 else None)
            for method in taking_turns(list(llms), n):
                [output], took = generate(llms[method], [prompt], params)
                outputs[method].append(output)
                tokens[method] += len(output.token_ids)
                seconds[method] += took
        base = tokens["none"] / seconds["none"]
        results[kind] = {}
        for method in llms:
            rate = tokens[method] / seconds[method]
            record = {"tokens_per_s": round(rate, 2), "ratio_vs_none": round(rate / base, 3)}
            if method != "none":
                record.update(spec_summary(outputs[method]))
                record["step_cost_ms"] = step_cost_now(llms[method])
                if temperature == 0:
                    record["same_tokens_as_none"] = (
                        [o.token_ids for o in outputs[method]]
                        == [o.token_ids for o in outputs["none"]])
            results[kind][method] = record
        print(f"[batch 1, T={temperature}, {kind}] " + ", ".join(
            f"{m} {r['ratio_vs_none']:.2f}x" for m, r in results[kind].items()),
            file=sys.stderr, flush=True)
    return results


def shifted(prompt: list[int], vocab_size: int) -> list[int]:
    """The prompt with every token id moved up by one: the same length (so the same step shapes),
    other text."""
    return [(token + 1) % vocab_size for token in prompt]


def warm_cell(llms: dict[str, LLM], batch: list[list[int]], params: SamplingParams) -> float:
    """An untimed pass of each engine over prompts shaped like `batch`; its seconds."""
    vocab_size = next(iter(llms.values())).engine.vocab_size
    warm_batch = [shifted(prompt, vocab_size) for prompt in batch]
    started = time.perf_counter()
    for llm in llms.values():
        generate(llm, warm_batch, params)
    return time.perf_counter() - started


def matrix(llms: dict[str, LLM], prompts: dict[str, list[list[int]]], max_tokens: int,
           levels: list[int], warmup_tokens: int) -> dict:
    """cells[kind][c][method]: c requests in one generate call, `none` run beside each method,
    both warmed first at that batch (`warmup_tokens` a request, untimed)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    warm_params = dataclasses.replace(params, max_tokens=max(warmup_tokens, 1))
    cells: dict = {}
    for kind, kind_prompts in prompts.items():
        cells[kind] = {}
        for level in levels:
            batch = [kind_prompts[i % len(kind_prompts)] for i in range(level)]
            row = {}
            for method, llm in llms.items():
                if method == "none":
                    continue
                warmup = (warm_cell({"none": llms["none"], method: llm}, batch, warm_params)
                          if warmup_tokens > 0 else 0.0)
                base_outputs, base_seconds = generate(llms["none"], batch, params)
                outputs, seconds = generate(llm, batch, params)
                base = sum(len(o.token_ids) for o in base_outputs) / base_seconds
                rate = sum(len(o.token_ids) for o in outputs) / seconds
                row[method] = {"tokens_per_s": round(rate, 2), "none_tokens_per_s": round(base, 2),
                               "ratio_vs_none": round(rate / base, 3), **spec_summary(outputs),
                               "same_tokens_as_none": ([o.token_ids for o in outputs]
                                                       == [o.token_ids for o in base_outputs]),
                               "seconds": round(seconds, 3), "none_seconds": round(base_seconds, 3),
                               "warmup_seconds": round(warmup, 3)}
            cells[kind][str(level)] = row
            print(f"[matrix {kind} c={level}] " + ", ".join(
                f"{m} {r['ratio_vs_none']:.2f}x" for m, r in row.items()),
                file=sys.stderr, flush=True)
    return cells


def weights_label(llm: LLM, model: str | None) -> str:
    """What the engine computes with: the file's GGUF blocks (CPU float32) or float weights
    dequantized from them (a GPU); a model path names itself."""
    if model is not None:
        return model
    native = any(getattr(m, "gguf", None) is not None for m in llm.engine.runner.model.modules())
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    return "native GGUF" if native else f"GGUF dequantized to {dtype}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded GGUF (native kernels)")
    p.add_argument("--workload", default=",".join(KINDS))
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--batch1-methods", default="none,ngram,eagle,eagle-head",
                   help=f"of {', '.join(METHODS)}; eagle@DIR and eagle-head@DIR read the head "
                        "in DIR (two heads side by side)")
    p.add_argument("--matrix-methods", default="none,ngram,eagle,layer-skip,draft")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--matrix-max-tokens", type=int, default=MIN_MATRIX_TOKENS,
                   help=f"tokens a request in a matrix cell (on a GPU >= {MIN_MATRIX_TOKENS})")
    p.add_argument("--matrix-warmup-tokens", type=int, default=64,
                   help="tokens a request of each cell's untimed warm-up pass (0: none)")
    p.add_argument("--draft-model-layers", type=int, default=6)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default) on any device: bfloat16 is not batch-invariant, and "
                        "the report says whether every method gives none's greedy tokens; "
                        "auto: the serving default (bfloat16 on CUDA)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every engine with --batch-invariant (on a GPU, bfloat16 verification "
                        "rounds as decoding: engine/models/invariant_linear.py)")
    p.add_argument("--padded-steps", action="store_true",
                   help="decode/verify steps in the padded layout CUDA graphs replay (the GPU "
                        "default; off on CPU otherwise), so the controller prices padded rows")
    p.add_argument("--output", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if torch.cuda.is_available() and args.matrix_max_tokens < MIN_MATRIX_TOKENS:
        p.error(f"--matrix-max-tokens {args.matrix_max_tokens}: on a GPU a cell needs at least "
                f"{MIN_MATRIX_TOKENS} tokens a request to measure the steady state")
    kinds = args.workload.split(",")
    batch1_methods = args.batch1_methods.split(",")
    matrix_methods = args.matrix_methods.split(",") if args.matrix_methods else []
    unknown = {m.partition(":overlap")[0].partition(":sync")[0].partition("@")[0]
               for m in batch1_methods + matrix_methods} - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}; known: {', '.join(METHODS)}")
    folder, model_name = resolve_model_folder(args.model)
    draft_folder = (build_truncated_draft(folder, args.draft_model_layers)
                    if "draft" in matrix_methods else None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = {kind: [encode(tokenizer, w) for w in load_workloads(kind, args.num_prompts)]
               for kind in kinds}
    layout = {"padded_steps": True} if args.padded_steps else {}
    if args.batch_invariant:
        layout["batch_invariant"] = True
    # kv_cache_memory_gib: the CPU's default; on a GPU, engines side by side must share it.
    llms = {m: LLM(args.model, enable_prefix_caching=False, kv_cache_memory_gib=CPU_KV_CACHE_GIB,
                   dtype=args.dtype, **layout,
                   **method_options(m, draft_folder))
            for m in dict.fromkeys(["none"] + batch1_methods + matrix_methods)}
    # Warm-up: every engine on every workload, long enough to verify drafts. On a GPU a kernel
    # or GEMM shape first used inside a timed run (verify rows' LM head, the sampler's) cost
    # whichever method met it first (docs/gpu-2026-11-28.md). Each matrix cell warms its own
    # batch again (`warm_cell`).
    started = time.perf_counter()
    for llm in llms.values():
        for kind in kinds:
            llm.generate(prompts[kind][0], SamplingParams(max_tokens=min(64, args.max_tokens),
                                                          temperature=0))
    warmup_seconds = time.perf_counter() - started
    report = {
        "benchmark": "spec_matrix",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name, "weights": weights_label(llms["none"], args.model),
        **device_facts(llms["none"].engine.device),
        "padded_layout": llms["none"].engine.static_runner is not None,
        "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "padded_steps": args.padded_steps, "batch_invariant": args.batch_invariant,
        "matrix_max_tokens": args.matrix_max_tokens,
        "matrix_warmup_tokens": args.matrix_warmup_tokens,
        "warmup_seconds": {"engines": round(warmup_seconds, 3)},
        "batch1": {}, "matrix": {},
    }
    for temperature in (float(t) for t in args.temperatures.split(",")):
        report["batch1"][str(temperature)] = batch_one(
            {m: llms[m] for m in dict.fromkeys(["none"] + batch1_methods)}, prompts,
            args.max_tokens, temperature)
    if matrix_methods:
        report["matrix"] = matrix({m: llms[m] for m in dict.fromkeys(["none"] + matrix_methods)},
                                  prompts, args.matrix_max_tokens,
                                  [int(c) for c in args.concurrency.split(",")],
                                  args.matrix_warmup_tokens)
        report["warmup_seconds"]["matrix_cells"] = round(sum(
            record["warmup_seconds"] for by_level in report["matrix"].values()
            for row in by_level.values() for record in row.values()), 3)
    emit(report, args.output, indent=1)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
