"""What a speculative method costs where its drafts rarely pay: each method beside `none` on one
workload at one concurrency (greedy, EOS ignored, prefix caching off, offline), the methods
taking turns --repeats times, with the proposer's own time (its `prepare`, `propose` and
`observe_target_step`) and the drafts it made. Issue 49's "never slower": a method that does not
draft should cost nothing measurable, and one whose drafts fail should fall back to `none`'s
speed. Single runs of such cells move by ±10% on a shared 2-vCPU host (the spec matrix's), so
this takes the median of several interleaved runs.

`--none-twins N` serves N more engines with no speculation beside the first (`none#2`, ...).
Engines alike in every setting can differ by a few percent in one process (probably where their
weights and caches landed: in a probe, three `none` engines read 1.000, 1.044 and 1.016 on chat
at batch 1, AMD EPYC Zen 4, every kernel at AVX2), so a method's ratio is also given against
the median of all the `none` engines, beside the spread of those engines' own ratios: the floor
below which a cell says nothing.

A method may carry options after colons: `eagle:random` drafts with an untrained head and
without EAGLE's copy lookup (so its drafts are never accepted), `:kept` holds the draft head's
retirement off (engine/spec_decode/head_retirement.py: what every request paid for the head
before it), so `eagle:random` beside `eagle:random:kept` is our own path with and without
retiring a head that does not pay.

    python -m benchmarks.experiments.method_overhead --workload chat --concurrency 1,8,16
    python -m benchmarks.experiments.method_overhead --methods eagle,eagle:kept,eagle:random
    python -m benchmarks.experiments.method_overhead --concurrency 1 --none-twins 2
    python -m benchmarks.experiments.method_overhead --none-twins 2 --processes 3

`--processes P` runs it all P times, each in a fresh process, and gives each method's ratio as
the median of the processes' (over_processes).

`--own-off` also runs every engine with its speculation switched off (`X/off`; own_off.py), and
gives each method against its own engine: no twins' floor of where memory landed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformers import AutoTokenizer

from benchmarks.experiments.own_off import against_own_off, speculation_off, turn_order
from benchmarks.machine import cpu_model, int8_variant, our_versions
from engine import LLM, SamplingParams
from engine.models.loader import resolve_model_folder
from specserve.bench.report import emit
from specserve.bench.workloads import encode, load_workloads

PROPOSER_PHASES = ("prepare", "propose", "observe_target_step")
METHOD_OPTIONS = ("random", "kept")


def random_head(model_name: str, folder: Path) -> Path:
    """An untrained head shaped like the one shipped for the model (its draft vocabulary and
    feature layers), saved in `folder`: its drafts are (almost) never accepted."""
    from safetensors.torch import load_file

    from engine.spec_decode.eagle_head import (CONFIG_FILE, WEIGHTS_FILE, EagleHead,
                                               EagleHeadConfig)
    from engine.spec_decode.factory import shipped_head

    shipped = shipped_head(model_name)
    config = EagleHeadConfig(**json.loads((shipped / CONFIG_FILE).read_text()))
    head = EagleHead(config.arch(), config.draft_vocab_size, config.feature_layers)
    head.init_weights(torch.Generator().manual_seed(0))
    head.token_ids.copy_(load_file(str(shipped / WEIGHTS_FILE))["token_ids"].long())
    config.training, config.target_name = None, "untrained (method_overhead)"
    head.save(folder, config)
    return folder


def build_llm(spec: str, model_name: str, scratch: Path) -> LLM:
    """`method[:random][:kept]` (the module's docstring)."""
    method, *options = spec.split("#")[0].split(":")
    unknown = set(options) - set(METHOD_OPTIONS)
    if unknown:
        raise SystemExit(f"unknown method option {sorted(unknown)} (known: {METHOD_OPTIONS})")
    extra = {}
    if "random" in options:
        extra["draft_head"] = str(random_head(model_name, scratch / "head"))
        if method == "eagle":
            extra["eagle_ngram_min"] = 0  # no copies: every draft is the untrained head's
    llm = LLM(None, speculative_method=method, enable_prefix_caching=False, **extra)
    if "kept" in options:
        proposer = llm.engine.proposer
        (proposer.head if method == "auto" else proposer).retire = False
    return llm


def timed_proposer(llm: LLM, seconds: collections.Counter) -> None:
    """Wraps the proposer's phases on this instance, adding their time to `seconds`."""
    proposer = llm.engine.proposer
    for name in PROPOSER_PHASES:
        method = getattr(proposer, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - started
        setattr(proposer, name, timed)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list]:
    """Seconds, draft tokens proposed, and the outputs' token ids."""
    stats = llm.engine.scheduler.spec_stats
    drafts_before = stats.num_draft_tokens
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    return seconds, stats.num_draft_tokens - drafts_before, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--methods", default="ngram,suffix,eagle,auto")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--none-twins", type=int, default=0,
                        help="this many more engines without speculation: the noise floor")
    parser.add_argument("--own-off", action="store_true",
                        help="also each speculative engine with its speculation off: X/off")
    parser.add_argument("--processes", type=int, default=1,
                        help="the whole run in this many fresh processes, one after another")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.processes > 1:
        return over_processes(args)
    folder, model_name = resolve_model_folder(None)
    scratch = Path(tempfile.mkdtemp(prefix="method_overhead_"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [encode(tokenizer, w) for w in load_workloads(args.workload, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    twins = [f"none#{i}" for i in range(2, 2 + args.none_twins)]
    speculative = args.methods.split(",")
    # With --own-off each engine's two kinds of run form a group; `none` runs twice too, the
    # floor of that comparison (one engine against itself, in the same turns).
    groups = [[m, f"{m}/off"] if args.own_off else [m] for m in ["none", *speculative]]
    groups[1:1] = [[twin] for twin in twins]
    methods = [m for group in groups for m in group]
    llms, phase_seconds = {}, {}
    for method in ["none", *twins, *speculative]:
        llms[method] = build_llm(method, model_name, scratch)
        if not method.startswith("none"):
            phase_seconds[method] = collections.Counter()
            timed_proposer(llms[method], phase_seconds[method])
    cells = {}
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        runs = {method: [] for method in methods}
        for counter in phase_seconds.values():
            counter.clear()
        for repeat in range(args.repeats):
            for method in turn_order(groups, repeat):
                engine_of, off = method.removesuffix("/off"), method.endswith("/off")
                with speculation_off(llms[engine_of]) if off else contextlib.nullcontext():
                    runs[method].append(run(llms[engine_of], batch, params))
        cells[concurrency] = _cell(runs, phase_seconds, concurrency * args.max_tokens)
        print(concurrency, {m: c.get("ratio_vs_none") for m, c in cells[concurrency].items()},
              file=sys.stderr)
    emit({"benchmark": "method_overhead", "cpu": cpu_model(), "int8_variant": int8_variant(),
          "versions": our_versions(), "workload": args.workload, "max_tokens": args.max_tokens,
          "repeats": args.repeats, "none_twins": args.none_twins, "own_off": args.own_off,
          "cells": cells}, args.output)


def over_processes(args) -> None:
    """Runs the measurement in `args.processes` fresh processes, one after another, and gives
    each method's ratio (to the median `none` where there are twins) as the median over them.
    Where engines land in memory is drawn again in every process, and within one it moved a
    method's ratio as much as the method did: three `none` engines in a probe read 1.014, 1.000
    and 0.945 (chat at batch 1, every kernel at AVX2, AMD EPYC Zen 4)."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="method_overhead_") as scratch:
        for index in range(args.processes):
            output = Path(scratch) / f"{index}.json"
            subprocess.run([sys.executable, "-m", "benchmarks.experiments.method_overhead",
                            "--workload", args.workload, "--methods", args.methods,
                            "--concurrency", args.concurrency, "--max-tokens",
                            str(args.max_tokens), "--repeats", str(args.repeats),
                            "--none-twins", str(args.none_twins), "--output", str(output),
                            *(["--own-off"] if args.own_off else [])],
                           check=True, stdout=subprocess.DEVNULL)
            reports.append(json.loads(output.read_text()))
    key = "paired_ratio_vs_own_off" if args.own_off else \
        "ratio_vs_nones" if args.none_twins else "ratio_vs_none"
    cells = combine_processes([report["cells"] for report in reports], key)
    for concurrency, cell in cells.items():
        print(concurrency, {m: c["ratio_median"] for m, c in cell.items() if m != "none_spread"},
              file=sys.stderr)
    emit({**{k: v for k, v in reports[0].items() if k != "cells"}, "ratio": key,
          "processes": args.processes, "cells": cells,
          "cells_by_process": [report["cells"] for report in reports]}, args.output)


def combine_processes(cells_by_process: list[dict], key: str) -> dict:
    """Per cell and method, the median over processes of its ratio `key`, with every process's
    ratio and drafts; and each process's `none_spread`."""
    cells = {}
    for concurrency, first in cells_by_process[0].items():
        runs = [cells[concurrency] for cells in cells_by_process]
        cells[concurrency] = {"none_spread": [c.get("none_spread") for c in runs]}
        for method in first:
            if method in ("none", "none_spread"):
                continue
            ratios = [c[method][key] for c in runs]
            cells[concurrency][method] = {
                "ratio_median": statistics.median(ratios), "ratios": ratios,
                "draft_tokens_per_run": [c[method]["draft_tokens_per_run"] for c in runs],
                "same_tokens_as_none": all(c[method]["same_tokens_as_none"] for c in runs)}
    return cells


def _cell(runs: dict, phase_seconds: dict, tokens: int) -> dict:
    """Medians per method against the first `none`'s, and against the median of every `none`
    engine's median (`ratio_vs_nones`) where there are twins (`none#2`, ...), whose own ratios
    to that median are the cell's `none_spread`."""
    medians = {m: statistics.median(seconds for seconds, _, _ in r) for m, r in runs.items()}
    none_seconds = medians["none"]
    nones = [m for m in runs if m.split("#")[0] == "none"]
    nones_seconds = statistics.median(medians[m] for m in nones)
    reference = runs["none"][0][2]
    cell = {"none": {"seconds_median": round(none_seconds, 4),
                     "tokens_per_s": round(tokens / none_seconds, 1)}}
    if "none/off" in runs:  # the same engine against itself: the floor of the next ratios
        cell["none"].update(against_own_off(runs["none"], runs["none/off"], reference))
    if len(nones) > 1:
        cell["none_spread"] = {m: round(nones_seconds / medians[m], 3) for m in nones}
    for method, method_runs in runs.items():
        if method in nones or method.endswith("/off"):
            continue
        seconds = [s for s, _, _ in method_runs]
        median = medians[method]
        cell[method] = {
            "seconds_median": round(median, 4), "tokens_per_s": round(tokens / median, 1),
            "ratio_vs_none": round(none_seconds / median, 3),
            "ratio_range": [round(none_seconds / max(seconds), 3),
                            round(none_seconds / min(seconds), 3)],
            "draft_tokens_per_run": statistics.median(d for _, d, _ in method_runs),
            "proposer_ms_per_run": {name: round(1e3 * s / len(method_runs), 2)
                                    for name, s in phase_seconds[method].items()},
            "same_tokens_as_none": all(out == reference for _, _, out in method_runs)}
        if len(nones) > 1:
            cell[method]["ratio_vs_nones"] = round(nones_seconds / median, 3)
        off = runs.get(f"{method}/off")
        if off:
            cell[method].update(against_own_off(method_runs, off, reference))
            cell[method]["own_off_vs_none"] = round(none_seconds / medians[f"{method}/off"], 3)
    return cell


if __name__ == "__main__":
    main()
