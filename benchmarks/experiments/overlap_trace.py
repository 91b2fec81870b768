"""Where an overlapped decode step's host time goes on a GPU: per step, the host time of each CUDA
runtime call (a launch that waits shows here) and of the heaviest torch ops, with overlap on and
off; and the host time of back-to-back graph replays alone. (Its run of 2026-11-28, JSON in
benchmarks/results, also timed the engine's two graph copies of a shape then, against one: the
copies were slower and are gone.)

    python -m benchmarks.experiments.overlap_trace --model FOLDER [--random-weights] [--output J]

On an H100 (2026-11-28) an overlapped step of the default model took 1.54 ms against 1.49 ms
synchronous, its replay call holding the host 0.45 ms; this found the cause (the copies). Speed
does not depend on weight values: `--random-weights` builds the folder's model with random bfloat16
weights (a config and tokenizer are all that must travel).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.machine import device_facts
from benchmarks.profile_step import run_steps
from specserve.bench.report import emit
from specserve.bench.workloads import encode, load_workloads


def random_folder(folder: str) -> str:
    """A copy of `folder`'s config and tokenizer with random bfloat16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp()) / "random"
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)
    return str(out)


def cuda_calls(prof, steps: int) -> dict:
    """Host ms and calls per step of every CUDA runtime/driver call, and the top torch ops."""
    calls, ops = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        name = event.key
        if name.startswith(("cuda", "cu")) and not name.startswith("cutlass"):
            calls[name] += event.cpu_time_total / 1e3 / steps
            counts[name] += event.count / steps
        elif name.startswith("aten::"):
            ops[name] += event.self_cpu_time_total / 1e3 / steps
    return {"runtime_calls": {n: {"ms": round(ms, 4), "calls": round(counts[n], 2)}
                              for n, ms in calls.most_common(14)},
            "top_ops_self_ms": {n: round(ms, 4) for n, ms in ops.most_common(10)}}


def replay_host_ms(engine, replays: int = 50) -> dict:
    """Host ms per replay call, launched back to back with no read between. A launch that
    waits for the previous replay to finish shows as about a step's device time per call."""
    runner = engine.static_runner
    if runner is None or not runner.graphs.enabled:
        return {}
    shapes = [shape for shape in runner.graphs.graphs if shape.query_len == 1]
    if not shapes:
        return {}
    shape = min(shapes, key=lambda s: s.num_seqs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    times = []
    for _ in range(replays):
        t = time.perf_counter()
        runner.graphs.run(shape)
        times.append(time.perf_counter() - t)
    launched = time.perf_counter() - started
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    times.sort()
    return {"host_ms_per_launch_median": round(1e3 * times[len(times) // 2], 4),
            "host_ms_per_launch_max": round(1e3 * times[-1], 4),
            "launch_loop_ms": round(1e3 * launched, 3), "until_done_ms": round(1e3 * total, 3)}


def measure(model: str, overlap: bool, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM(model, speculative_method="none", enable_prefix_caching=False,
              kv_cache_memory_gib=1.0, max_num_seqs=1, max_model_len=2048,
              async_scheduling=overlap)
    engine = llm.engine
    prompt = encode(llm.tokenizer, load_workloads("code", 1)[0])
    params = SamplingParams(max_tokens=steps * 4 + 64, temperature=0, ignore_eos=True)
    run_steps(engine, prompt, steps, params)  # warm-up
    runs = sorted(run_steps(engine, prompt, steps, params)[0] for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(engine, prompt, steps, params)
    result = {"ms_per_step": round(1e3 * runs[1] / steps, 4), **cuda_calls(prof, steps),
              "replays": replay_host_ms(engine)}
    del llm, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--output")
    args = parser.parse_args()
    model = random_folder(args.model) if args.random_weights else args.model
    results = {"overlap": measure(model, True, args.steps),
               "sync": measure(model, False, args.steps)}
    emit({"benchmark": "overlap_trace", "date": time.strftime("%Y-%m-%d"),
          **device_facts(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
          "model": args.model,
          "random_weights": args.random_weights, "steps": args.steps, "results": results},
         args.output)


if __name__ == "__main__":
    main()
