"""Host time of a decode step, where a GPU would be waiting on Python: this tree beside another.

On a GPU a CUDA-graph step computes in ~1-3 ms, so the host's share of a step (scheduling,
building inputs, emitting text) and the number of kernels a graph replays set the speed. Both
can be measured without a GPU: a tiny model (2 layers, hidden 64, the default model's tokenizer
and 49152-token vocabulary) makes the model's own compute small, and counting aten ops per
decoder layer on the torch path (what CUDA runs; `--ops fused` takes the CPU's fused ops)
counts the kernels a graph would replay.

For each batch size, greedy decoding of `--max-tokens` tokens per request (EOS ignored) is timed
step by step; the phases are timed by wrapping the engine's own methods, so the same script
measures an older tree: `--baseline REF` checks REF out into a temporary git worktree and runs
this script there as a subprocess, the two trees taking turns `--repeats` times. Prints JSON.

    python -m benchmarks.host_overhead [--baseline d25ca0b] [--batch-sizes 1 16 64]
        [--method ngram]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = {  # phase -> (owner path, attribute) wrapped with a timer
    "schedule": ("engine.scheduler", "schedule"),
    "prepare_padded": ("engine.static_runner", "prepare"),
    # the flat step's inputs: a free function the engine called, or (newer trees) its runner's
    "prepare_flat": ("engine_module", "build_model_input"),
    "prepare_flat_runner": ("engine.runner", "prepare"),
    "forward_padded": ("engine.static_runner", "run"),
    "forward_flat": ("engine.runner", "execute"),
    "sample": ("engine_module", "verify_requests"),
    # newer trees: verification behind engine/failures.py's per-request failure handling
    "sample_step": ("engine_module", "verify_step"),
    "update": ("engine.scheduler", "update_from_output"),
    "emit": ("engine", "_emit"),
    # with --method ngram: the drafts' planning and lookup, and what the step taught them
    "propose": ("engine.speculation", "propose"),
    "observe": ("engine.speculation", "observe"),
}
VIEW_OPS = {"view", "_unsafe_view", "transpose", "t", "expand", "unsqueeze", "squeeze", "split",
            "split_with_sizes", "slice", "select", "as_strided", "detach", "alias", "permute",
            "_reshape_alias", "reshape", "flatten", "unflatten", "narrow", "lift_fresh"}


def tiny_model(folder: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engine.models.loader import resolve_model_folder

    default_folder, _ = resolve_model_folder(None)
    config = AutoConfig.for_model(
        "llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_folder).save_pretrained(folder)
    return str(folder)


class PhaseTimer:
    """Wraps engine methods so each call adds its wall time to a phase."""

    def __init__(self, llm):
        import engine.engine as engine_module

        self.seconds: collections.Counter[str] = collections.Counter()
        self.steps = 0
        roots = {"engine": llm.engine, "engine_module": engine_module}
        for phase, (path, attribute) in PHASES.items():
            root, *rest = path.split(".")
            owner = roots[root]
            for name in rest:
                owner = getattr(owner, name, None)
            if owner is not None and hasattr(owner, attribute):
                setattr(owner, attribute,
                        self._timed(phase.removesuffix("_runner").removesuffix("_step"),
                                    getattr(owner, attribute)))
        step = llm.engine.step

        def counted_step():
            self.steps += 1
            return step()
        llm.engine.step = counted_step

    def _timed(self, phase, function):
        return timed_into(self.seconds, phase, function)


def timed_into(seconds: collections.Counter, phase: str, function):
    """`function`, wrapped so that each call adds its wall time to seconds[phase]."""
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[phase] += time.perf_counter() - started
    return timed


class KernelCount(TorchDispatchMode):
    """aten ops that launch work, by name: views, aliases and bare allocations are left out."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS and not name.startswith("empty"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


# The CPU's default KV budget, on any device: on a GPU the engines this process makes one after
# another must not each claim 0.9 of the card. A literal, not engine.memory's constant: this
# code also runs against a baseline tree's engine.
KV_CACHE_GIB = 1.0


def ops_per_layer(folder: str) -> float:
    """Non-view aten ops in one decoder layer of a padded decode step, batch 1. Counted in an
    eager engine: a CUDA graph replays what the eager forward dispatches, without calling it."""
    from engine import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", padded_steps=True, enforce_eager=True,
              speculative_method="none", kv_cache_memory_gib=KV_CACHE_GIB)
    layer = llm.engine.runner.model.layers[1]
    counts, forward = [], layer.forward

    def counted(*args, **kwargs):
        with KernelCount() as count:
            out = forward(*args, **kwargs)
        counts.append(sum(count.ops.values()))
        return out
    layer.forward = counted
    llm.generate(["Count the ops."], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    layer.forward = forward
    return counts[-1]


def cpu_isa_flags() -> list[str]:
    """The CPU's vector flags that tell its kind apart (AVX2-only Zen 3, AVX-512 VNNI Zen 4,
    AMX Xeon): the model name alone reads "AMD EPYC" on both EPYCs."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_vnni", "amx_int8"})


def measure(args) -> dict:
    """Runs in whichever tree is on sys.path: the results of this tree's engine."""
    if args.ops == "torch":
        import engine.quant.kernels as kernels

        kernels.load_kernel = lambda: None  # noqa: E731 - the torch path CUDA runs
    from engine import LLM, SamplingParams

    folder = tiny_model(Path(tempfile.mkdtemp()))
    results = {}
    for layout in args.layouts:
        llm = LLM(folder, dtype="float32", padded_steps=layout == "padded",
                  speculative_method=args.method, enable_prefix_caching=False,
                  max_num_seqs=max(args.batch_sizes), kv_cache_memory_gib=KV_CACHE_GIB)
        per_layer = ops_per_layer(folder) if layout == "padded" else None
        timer = PhaseTimer(llm)
        for batch in args.batch_sizes:
            prompts = [f"Tell me story number {i} about a lighthouse keeper and her cat."
                       for i in range(batch)]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            llm.generate(prompts, params)  # warm-up
            timer.seconds.clear()
            timer.steps = 0
            started = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - started
            phases = {phase: 1e3 * s / timer.steps for phase, s in timer.seconds.items()}
            forward = sum(v for k, v in phases.items() if k.startswith("forward"))
            results[f"{layout}/batch{batch}"] = {
                "ms_per_step": 1e3 * wall / timer.steps,
                "host_ms_per_step": 1e3 * wall / timer.steps - forward - phases.get("sample", 0),
                "phases_ms_per_step": phases,
                "steps": timer.steps,
                "ops_per_decoder_layer": per_layer,
            }
    return results


def run_tree(tree: Path, args) -> dict:
    """This script, run as a subprocess with `tree` first on the import path."""
    from benchmarks.machine import measure_in_tree  # here: older trees run --measure-only

    method = ["--method", args.method] if args.method != "none" else []  # older trees: none
    return measure_in_tree(Path(__file__).resolve(), tree,
                           ["--ops", args.ops, "--max-tokens", str(args.max_tokens),
                            "--batch-sizes", *map(str, args.batch_sizes),
                            "--layouts", *args.layouts, *method])


def median_of(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        cell = dict(runs[0][key])
        for field in ("ms_per_step", "host_ms_per_step"):
            cell[field] = round(statistics.median(r[key][field] for r in runs), 3)
        cell["phases_ms_per_step"] = {
            phase: round(statistics.median(r[key]["phases_ms_per_step"].get(phase, 0.0)
                                           for r in runs), 3)
            for phase in cell["phases_ms_per_step"]}
        out[key] = cell
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to measure beside this tree")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layouts", nargs="+", default=["padded", "flat"],
                        choices=["padded", "flat"])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ops", default="torch", choices=["torch", "fused"])
    parser.add_argument("--method", default="none", help="the speculative method (ngram: its "
                        "planning and lookup count as host time)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args)))
        return
    # here, not at the top: the measuring subprocess imports an older tree's `benchmarks`
    from benchmarks.machine import ROOT, baseline_tree

    with baseline_tree(args.baseline) as baseline:
        trees = {"this": ROOT, **({"baseline": baseline} if baseline else {})}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):  # the trees take turns
            for name, tree in trees.items():
                runs[name].append(run_tree(tree, args))
    from benchmarks.machine import cpu_model  # this tree's (a baseline's may lack it)

    result = {
        "benchmark": "host_overhead",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_model(), "cpu_flags": cpu_isa_flags(),
                    "platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "config": {"batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
                   "ops": args.ops, "repeats": args.repeats, "baseline": args.baseline,
                   "method": args.method,
                   "model": "tiny llama: 2 layers, hidden 64, vocab 49152, float32, CPU"},
        "results": {name: median_of(r) for name, r in runs.items()},
    }
    if args.baseline:
        this, base = result["results"]["this"], result["results"]["baseline"]
        result["ratios_baseline_over_this"] = {
            key: {field: round(base[key][field] / this[key][field], 2)
                  for field in ("ms_per_step", "host_ms_per_step")} for key in this}
    from specserve.bench.report import emit  # here: --measure-only runs in older trees too

    emit(result, args.output, indent=2)


if __name__ == "__main__":
    main()
