"""`specserve bench offline`: speculative decoding in one process, our proposers against
transformers.

Default model, float32, greedy, batch 1, `--max-tokens` new tokens per prompt (EOS ignored), on
the workload kinds of workloads.py (code, copy, chat). Systems: ours/<method> is
LLM(speculative_method=method) for none, ngram, layer-skip, draft; hf/plain, hf/pld and
hf/assistant are transformers generate() plain, with prompt_lookup_num_tokens=10 and with
assistant_model=draft. The draft is the target's first `--draft-model-layers` layers, saved once
under ~/.cache/specserve/bench/. Tokens/s of a (system, kind): generated tokens / seconds summed
over the kind's prompts, each prompt timed as the best of `--repeats` runs, the systems taking
turns on every prompt so that machine noise hits them alike. Prefix caching is off: every prompt
is prefilled, as in transformers. Then all prompts, cycled to `--concurrency` requests, go to one
LLM.generate call with ngram speculation and without. Compare ratios, not absolute numbers.
JSON goes to stdout (and --output), a table to stderr, a bar chart to --plot.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.bench.report import finish
from specserve.bench.workloads import encode, load_workloads
from engine import LLM, SamplingParams
from engine.core.memory import CPU_KV_CACHE_GIB
from engine.metrics.spec_stats import SpecStats
from engine.models.loader import cache_dir, resolve_model_folder

OUR_METHODS = ("none", "ngram", "layer-skip", "draft")
HF_MODES = ("plain", "pld", "assistant")
BASELINE = "ours/none"
# kv_cache_memory_gib: the CPU's default, on any device, so that the engines side by side in
# this process share a GPU (each would otherwise claim 0.9 of it, and the second be refused).
ENGINE_OPTIONS = {"dtype": "float32", "enable_prefix_caching": False,
                  "kv_cache_memory_gib": CPU_KV_CACHE_GIB}


@dataclass
class Run:
    """One timed generate of one prompt."""

    token_ids: list[int]  # generated tokens only
    seconds: float
    spec_stats: SpecStats | None = None  # ours only


System = Callable[[list[int], int], Run]  # (prompt token ids, max new tokens) -> Run


def build_truncated_draft(folder: Path, num_layers: int) -> Path:
    """A Hugging Face folder holding the target's first `num_layers` decoder layers (plus its
    embeddings, final norm and head), written once and reused."""
    out = cache_dir() / "bench" / f"{folder.name}-first{num_layers}"
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if not 1 <= num_layers < model.config.num_hidden_layers:
        raise ValueError(f"--draft-model-layers must be in [1, {model.config.num_hidden_layers})"
                         f", got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(folder).save_pretrained(partial)
    partial.rename(out)  # a half-written folder is never mistaken for a finished one
    return out


def ours(llm: LLM, speculative: bool) -> System:
    def run(prompt_ids: list[int], max_tokens: int) -> Run:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        [output] = llm.generate(prompt_ids, params)
        seconds = time.perf_counter() - start
        return Run(list(output.token_ids), seconds, output.spec_stats if speculative else None)
    return run


def transformers_generate(model, **options) -> System:
    pad_token_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id

    def run(prompt_ids: list[int], max_tokens: int) -> Run:
        input_ids = torch.tensor([prompt_ids])  # [1, num_prompt_tokens]
        start = time.perf_counter()
        with torch.inference_mode():
            sequences = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_token_id,
                **options)  # [1, num_prompt_tokens + max_tokens]
        seconds = time.perf_counter() - start
        return Run(sequences[0, len(prompt_ids):].tolist(), seconds)
    return run


def build_systems(methods: list[str], hf_modes: list[str], folder: Path,
                  draft_folder: Path | None) -> tuple[dict[str, LLM], dict[str, System]]:
    llms = {method: LLM(model=str(folder), speculative_method=method, **ENGINE_OPTIONS,
                        **({"draft_model": str(draft_folder)} if method == "draft" else {}))
            for method in methods}
    systems = {f"ours/{method}": ours(llm, method != "none") for method, llm in llms.items()}
    if hf_modes:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        options = {"plain": {}, "pld": {"prompt_lookup_num_tokens": 10}}
        if "assistant" in hf_modes:
            options["assistant"] = {"assistant_model": AutoModelForCausalLM.from_pretrained(
                draft_folder, dtype=torch.float32).eval()}
        systems.update({f"hf/{mode}": transformers_generate(hf_model, **options[mode])
                        for mode in hf_modes})
    return llms, systems


def measure_kind(systems: dict[str, System], prompts: list[list[int]], max_tokens: int,
                 repeats: int) -> dict[str, list[list[Run]]]:
    """runs[system][prompt index][repeat]; on each prompt the systems take turns."""
    runs: dict[str, list[list[Run]]] = {name: [] for name in systems}
    for prompt_ids in prompts:
        for name in systems:
            runs[name].append([])
        for _ in range(repeats):
            for name, system in systems.items():
                runs[name][-1].append(system(prompt_ids, max_tokens))
    return runs


def summarize(runs: list[list[Run]]) -> dict:
    """Throughput over the best run of each prompt, plus speculation counters where present."""
    best = [min(prompt_runs, key=lambda run: run.seconds) for prompt_runs in runs]
    num_tokens = sum(len(run.token_ids) for run in best)
    seconds = sum(run.seconds for run in best)
    record = {"tokens_per_s": round(num_tokens / seconds, 2), "num_tokens": num_tokens,
              "seconds": round(seconds, 3)}
    if best[0].spec_stats is not None:
        stats = SpecStats()
        for run in best:
            stats.merge(run.spec_stats)
        record.update(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                      num_accepted_tokens=stats.num_accepted_tokens,
                      # None, not 0, when the controller drafted nothing at all
                      acceptance_rate=(round(stats.acceptance_rate, 4)
                                       if stats.num_draft_tokens else None),
                      mean_acceptance_length=(round(stats.mean_acceptance_length, 3)
                                              if stats.num_drafts else None))
    return record


def same_tokens(runs: list[list[Run]], reference: list[list[Run]]) -> bool:
    """True when every run of every prompt equals the reference's first run, token for token."""
    return all(run.token_ids == ref_runs[0].token_ids
               for prompt_runs, ref_runs in zip(runs, reference) for run in prompt_runs)


def compare_kind(runs: dict[str, list[list[Run]]]) -> dict[str, dict]:
    records = {name: summarize(system_runs) for name, system_runs in runs.items()}
    base = records.get(BASELINE)
    for name, record in records.items():
        record["speedup_vs_ours_none"] = (
            round(record["tokens_per_s"] / base["tokens_per_s"], 3) if base else None)
        if name.startswith("ours/") and name != BASELINE:
            record["same_tokens_as_none"] = (
                same_tokens(runs[name], runs[BASELINE]) if base else None)
    return records


def measure_concurrency(llms: dict[str, LLM], prompts: list[list[int]], num_requests: int,
                        max_tokens: int, repeats: int) -> dict:
    """All prompts (cycled to `num_requests`) submitted in one generate call per engine."""
    batch = [prompts[i % len(prompts)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rates: dict[str, float] = {}
    token_ids: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs = llm.generate(batch, params)
            seconds = time.perf_counter() - start
            rate = sum(len(output.token_ids) for output in outputs) / seconds
            rates[name] = max(rate, rates.get(name, 0.0))
            token_ids[name] = [list(output.token_ids) for output in outputs]
    return {"num_requests": num_requests,
            "tokens_per_s": {name: round(rate, 2) for name, rate in rates.items()},
            "ratio_ngram_vs_none": round(rates["ngram"] / rates["none"], 3),
            "same_tokens_ngram_as_none": token_ids["ngram"] == token_ids["none"]}


def print_table(results: dict[str, dict[str, dict]], kinds: list[str]) -> None:
    print(f"{'system':16s}" + "".join(f"{kind:36s}" for kind in kinds).rstrip(), file=sys.stderr)
    for name, by_kind in results.items():
        cells = []
        for kind in kinds:
            record = by_kind[kind]
            speedup = record["speedup_vs_ours_none"]
            cell = f"{record['tokens_per_s']:6.1f} tok/s"
            cell += f" {speedup:5.2f}x" if speedup is not None else ""
            if "acceptance_rate" in record:
                same = {True: "=", False: "!", None: "?"}[record.get("same_tokens_as_none")]
                rate, length = record["acceptance_rate"], record["mean_acceptance_length"]
                cell += f" a{rate or 0:.2f} L{length or 0:.2f} {same}"
            cells.append(f"{cell:36s}")
        print(f"{name:16s}" + "".join(cells).rstrip(), file=sys.stderr)
    print("speedup vs ours/none; a: acceptance rate, L: mean acceptance length, "
          "=/!: greedy tokens equal/differ from ours/none", file=sys.stderr)


def run(args) -> dict:
    """The whole `bench offline` command (arguments as specserve/bench/cli.py defines them)."""
    kinds, methods, hf_modes = args.workload, args.methods, args.hf_modes
    if not methods + hf_modes:
        raise ValueError("name at least one of --methods / --hf-modes")
    folder, model_name = resolve_model_folder(args.model)
    draft_folder = None
    if "draft" in methods or "assistant" in hf_modes:
        draft_folder = build_truncated_draft(folder, args.draft_model_layers)
    llms, systems = build_systems(methods, hf_modes, folder, draft_folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    workloads = {kind: load_workloads(kind, args.num_prompts) for kind in kinds}
    prompts = {kind: [encode(tokenizer, w) for w in items] for kind, items in workloads.items()}
    warmup_prompt = prompts[kinds[0]][0]
    for system in systems.values():
        system(warmup_prompt, min(args.max_tokens, 32))

    results: dict[str, dict[str, dict]] = {name: {} for name in systems}
    for kind in kinds:
        runs = measure_kind(systems, prompts[kind], args.max_tokens, args.repeats)
        for name, record in compare_kind(runs).items():
            results[name][kind] = record
        print(f"[{kind}] done", file=sys.stderr, flush=True)

    concurrency = None
    if args.concurrency:
        for method in ("none", "ngram"):
            if method not in llms:
                llms[method] = LLM(model=str(folder), speculative_method=method, **ENGINE_OPTIONS)
        all_prompts = [ids for kind in kinds for ids in prompts[kind]]
        concurrency = measure_concurrency({m: llms[m] for m in ("none", "ngram")}, all_prompts,
                                          args.concurrency, args.max_tokens, args.repeats)

    report = {
        "benchmark": "offline",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name, "dtype": "float32", "torch_threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens, "repeats": args.repeats, "num_prompts": args.num_prompts,
        "draft_model": ({"folder": str(draft_folder), "num_layers": args.draft_model_layers}
                        if draft_folder else None),
        "machine": platform.platform(),  # a busy machine (1/5/15-min load) skews everything:
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "prompts": {kind: {w.id: len(ids) for w, ids in zip(workloads[kind], prompts[kind])}
                    for kind in kinds},
        "results": results,
        "concurrency": concurrency,
    }
    print_table(results, kinds)
    if concurrency:
        print(f"concurrency {args.concurrency}: {concurrency['tokens_per_s']} tok/s, ngram/none "
              f"{concurrency['ratio_ngram_vs_none']}x", file=sys.stderr)
    finish(report, args.output, args.plot)
    return report
