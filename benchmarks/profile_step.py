"""Where a batch-1 decode step's time goes, per method: host ms by phase, device-busy ms, kernels,
launches and host-device syncs, over `--steps` consecutive steps of one request.

    python -m benchmarks.profile_step [--model tiny|PATH] [--methods none,ngram,eagle]

Phases are timed by wrapping the engine's own methods (so the same script reads any tree):
schedule, propose, prepare, forward (graph replay or eager forward, LM head excluded), lm_head,
sample (verification and sampling on the device, the host read excluded), host_read (the step's
one device-to-host copy: on a GPU this is where the host waits for the device), observe, update,
emit (detokenizing and stop strings) and output (building each RequestOutput, what streaming
hands on). `other` is the rest of `step()`. A second pass over the same number of steps runs
under `torch.profiler`: kernels executed, host launch calls (kernel and graph launches),
synchronizing calls, and device-busy ms (the sum of kernel times; one stream, so no overlap).
On CPU the profiler sees no device: device-busy is null and the forward phase is the compute.

`--model tiny` is a 2-layer random Llama with the default model's tokenizer (host time shows;
compute is small). Prints JSON; `--output` writes it too.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.host_overhead import timed_into
from benchmarks.machine import device_facts
from specserve.bench.report import emit
from specserve.bench.workloads import encode, load_workloads

# phase -> (owner path from the engine, attribute). Nested phases are subtracted from their
# callers below, so each phase is self time. Overlapped steps (engine/runner/overlap.py) have their own
# names for the same phases.
PHASES = [
    ("schedule", "scheduler", "schedule"),
    ("propose", "speculation", "propose"),
    ("prepare", "static_runner", "prepare"),
    ("prepare_flat", "runner", "prepare"),
    ("forward", "static_runner", "run"),
    ("forward_flat", "runner", "execute"),
    ("lm_head", "runner.model", "logits"),
    ("sample", "@engine.engine", "verify_requests"),
    ("sample", "@engine.runner.overlap", "sample_on_device"),
    ("host_read", "@engine.sample.verifier", "read_tokens"),
    ("host_read", "@engine.core.device", "PendingRead.result"),
    ("observe", "speculation", "observe"),
    ("update", "scheduler", "update_from_output"),
    ("emit", "", "_emit"),
    ("output", "", "_output"),
]
NESTED = {"forward": ["lm_head"], "forward_flat": ["lm_head"], "sample": ["host_read"],
          "emit": ["output"]}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch",
                "cuLaunchKernelEx")


class PhaseClock:
    """Wraps engine methods so that each call adds its wall time to a phase."""

    def __init__(self, engine):
        import importlib

        self.seconds: collections.Counter[str] = collections.Counter()
        self._undo = []
        for phase, path, attribute in PHASES:
            if path.startswith("@"):
                owner = importlib.import_module(path[1:])
            else:
                owner = engine
                for name in filter(None, path.split(".")):
                    owner = getattr(owner, name, None)
            *classes, attribute = attribute.split(".")
            for name in classes:
                owner = getattr(owner, name, None)
            if owner is not None and hasattr(owner, attribute):
                original = getattr(owner, attribute)
                setattr(owner, attribute, timed_into(self.seconds, phase, original))
                self._undo.append((owner, attribute, original))

    def self_times(self, step_seconds: float, steps: int) -> dict[str, float]:
        """ms per step of each phase, nested phases taken out of their callers; `other` is what
        `step()` spent outside every phase."""
        merged = collections.Counter()
        for phase, seconds in self.seconds.items():
            merged[phase.removesuffix("_flat")] += seconds
        for outer, inner in NESTED.items():
            if outer in merged:
                merged[outer] -= sum(merged.get(name, 0.0) for name in inner)
        tops = sum(s for p, s in merged.items())
        merged["other"] = step_seconds - tops
        return {phase: round(1e3 * s / steps, 4) for phase, s in sorted(merged.items())}

    def close(self):
        for owner, attribute, original in reversed(self._undo):
            setattr(owner, attribute, original)


def run_steps(engine, prompt_ids: list[int], steps: int, params,
              after_prefill=lambda: None) -> tuple[float, int]:
    """One request, `steps` engine steps after its prefill; (seconds, tokens emitted)."""
    request_id = engine.add_request(prompt_ids, params)
    engine.step()  # the prefill
    after_prefill()
    tokens, started = 0, time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
        tokens += sum(len(o.delta_token_ids) for o in outputs)
    seconds = time.perf_counter() - started
    engine.abort(request_id)
    return seconds, tokens


def profiled_counts(engine, prompt_ids, steps, params, device) -> dict:
    """Kernels, launches, syncs and device-busy ms per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run_steps(engine, prompt_ids, steps, params)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    copies_to_host = sum(1 for e in events if e.name == "aten::_local_scalar_dense"
                         or e.name.startswith("Memcpy DtoH"))
    busy_us = sum(e.device_time for e in kernels) if kernels else None
    top, top_us = collections.Counter(), collections.Counter()
    for e in kernels:
        top[e.name[:80]] += 1
        top_us[e.name[:80]] += e.device_time
    return {
        "kernels_per_step": round(len(kernels) / (steps + 1), 1) if device.type == "cuda" else None,
        "host_launch_calls_per_step": round(launches / (steps + 1), 2),
        "syncs_per_step": round(syncs / (steps + 1), 2),
        "device_to_host_copies_per_step": round(copies_to_host / (steps + 1), 2),
        "device_busy_ms_per_step": None if busy_us is None else round(busy_us / 1e3 / (steps + 1),
                                                                       4),
        "top_kernels": dict(top.most_common(12)),
        "top_kernels_device_ms_per_step": {name: round(us / 1e3 / (steps + 1), 4)
                                           for name, us in top_us.most_common(12)},
    }


def profile_method(model: str, method: str, args, device) -> dict:
    from engine import LLM, SamplingParams

    # One sequence, a short context: few graph shapes to capture at start.
    options = {"speculative_method": method, "enable_prefix_caching": False,
               "kv_cache_memory_gib": 1.0, "dtype": args.dtype, "max_num_seqs": 1,
               "max_model_len": 2048, "attention_backend": args.attention_backend,
               "batch_invariant": args.batch_invariant, "fused_kernels": args.fused_kernels,
               "async_scheduling": {"on": True, "off": False}.get(args.async_scheduling)}
    llm = LLM(model, **options)
    engine = llm.engine
    prompt_ids = encode(llm.tokenizer, load_workloads(args.workload, 1)[0])
    params = SamplingParams(max_tokens=args.steps * 8 + 64, temperature=0, ignore_eos=True)
    run_steps(engine, prompt_ids, args.steps, params)  # warm-up
    clock = PhaseClock(engine)
    wall = []
    overlapped_before = engine.overlap.num_overlapped if engine.overlap else 0
    for _ in range(args.repeats):
        seconds, tokens = run_steps(engine, prompt_ids, args.steps, params, clock.seconds.clear)
        wall.append((seconds, tokens, dict(clock.seconds)))
    clock.close()
    # the median repeat by wall time, with its own phases
    seconds, tokens, phase_seconds = sorted(wall, key=lambda w: w[0])[len(wall) // 2]
    clock.seconds = collections.Counter(phase_seconds)
    result = {
        "ms_per_step": round(1e3 * seconds / args.steps, 4),
        "tokens_per_step": round(tokens / args.steps, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_step_all_repeats": [round(1e3 * w[0] / args.steps, 4) for w in wall],
        "host_ms_by_phase": clock.self_times(seconds, args.steps),
        # steps launched before the one before them landed (a speculative engine's quiet steps)
        "overlapped_share": round(((engine.overlap.num_overlapped if engine.overlap else 0)
                                   - overlapped_before) / (args.steps * args.repeats), 3),
    }
    # layers on the fused decode/verify kernels (engine/models/fused_layer.py)
    result["fused_layers"] = sum(bool(getattr(layer, "fused", False))
                                 for layer in getattr(getattr(engine.runner, "model", None),
                                                      "layers", ()))
    result.update(profiled_counts(engine, prompt_ids, args.steps, params, device))
    result["graph_replay_ms"] = graph_replay_ms(engine, prompt_ids, params, device)
    del llm, engine
    return result


def graph_replay_ms(engine, prompt_ids, params, device, replays: int = 200) -> float | None:
    """The device's floor for a batch-1 decode step: its graph (forward, LM head, argmax)
    replayed back to back, timed by CUDA events; no host work between replays. None where no
    graph runs (CPU, or graphs off)."""
    runner = engine.static_runner
    if device.type != "cuda" or runner is None or not runner.graphs.enabled:
        return None
    shapes, prepare = [], runner.prepare

    def spy(scheduled, *rest):
        step = prepare(scheduled, *rest)
        shapes.append(step.shape)
        return step

    runner.prepare = spy
    run_steps(engine, prompt_ids, 2, params)
    runner.prepare = prepare
    decode = [shape for shape in shapes if shape.query_len == 1]
    if not decode:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        runner.graphs.run(decode[-1])
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / replays, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model path, 'tiny', or the default")
    parser.add_argument("--methods", default="none,ngram,eagle")
    parser.add_argument("--workload", default="code")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine with --batch-invariant (row-invariant GPU kernels)")
    parser.add_argument("--fused-kernels", default="auto", choices=["auto", "off"],
                        help="the layers' fused decode/verify kernels (engine/models/"
                             "fused_layer.py; auto: on CUDA in bf16/fp16)")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="overlapped steps (auto: on for CUDA)")
    parser.add_argument("--output")
    args = parser.parse_args()
    from engine.core.device import pick_device

    device = pick_device(None)
    model = args.model
    if model == "tiny":
        from benchmarks.host_overhead import tiny_model

        model = tiny_model(Path(tempfile.mkdtemp()))
    results = {}
    for method in args.methods.split(","):
        try:
            results[method] = profile_method(model, method, args, device)
        except (ValueError, RuntimeError) as error:  # e.g. no EAGLE head for this model
            results[method] = {"error": str(error)[:300]}
    none = results.get("none", {}).get("ms_per_step")
    for method, result in results.items():
        if none and "tokens_per_s" in result and "tokens_per_s" in results["none"]:
            result["speed_vs_none"] = round(result["tokens_per_s"]
                                            / results["none"]["tokens_per_s"], 3)
    emit({"benchmark": "profile_step", "date": time.strftime("%Y-%m-%d"),
          **device_facts(device),
          "config": {"model": args.model or "default (SmolLM2-135M-Instruct)", "dtype": args.dtype,
                     "attention_backend": args.attention_backend,
                     "batch_invariant": args.batch_invariant,
                     "fused_kernels": args.fused_kernels,
                     "async_scheduling": args.async_scheduling, "steps": args.steps, "repeats": args.repeats, "workload": args.workload,
                     "batch": 1, "greedy": True},
          "results": results}, args.output)


if __name__ == "__main__":
    main()
