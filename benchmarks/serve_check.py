"""Issue 70's serving figures in one run (`benchmarks/device_check.sh serve70` on a lent GPU): the
server on the default model, measured from outside with `specserve bench serve`.

    python -m benchmarks.serve_check --output $OUT/serve70_h200.json [--server-args "..."]

1. Cold start to `/ready` (an empty Triton kernel cache), then on that server:
   - the first requests after `/ready` (`--first-requests`, 100) against the same traffic again
     (steady): TTFT p99 of each and their ratio (target <= 2);
   - TTFT at batch 1, streamed chat, prompts of 16 to 512 tokens (target p50 <= 15 ms);
   - 64 concurrent x 256 tokens, ignoring EOS, twice (the first round, then steady): tokens/s
     and TTFT p50 (targets >= 25,000 tok/s and <= 50 ms);
   - the first-use counters after ready (engine/metrics/first_use.py; target 0).
2. Warm start to `/ready` (the kernels on disk now; target <= 15 s; cold <= 45 s).
3. benchmarks/agentic.py at batch 1 on the agent loop and templated traffic: `none` and `suffix`
   through servers against the same engines offline (targets: server/offline >= 0.8, suffix
   over none >= 1.5).

One JSON names the GPU (or CPU) and the torch, Triton and CUDA versions. `--scale` shrinks every
count for a dry run on a CPU with a tiny model (`--server-args "--model DIR --device cpu"`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.agentic_servers import free_ports
from benchmarks.machine import cpu_model, our_versions
from specserve.bench.report import emit

PROMPT_TOKENS = (16, 64, 128, 256, 512)
COUNTERS = ("graph_captures_after_ready_total", "shape_first_use_after_ready_total",
            "kernel_compiles_after_ready_total")


def counts(scale: float) -> dict:
    """Request counts at `scale` (1: the issue's)."""
    def at(n: int) -> int:
        return max(2, round(n * scale))
    return {"first_requests": at(100), "ttft_prompts": at(8), "concurrency": at(64),
            "concurrent_requests": at(256), "concurrent_tokens": at(256)}


def filler_prompt(tokenizer, num_tokens: int, seed: int) -> str:
    """A user message whose chat-templated prompt is about `num_tokens` long (at least the
    template's own tokens: SmolLM2's adds a system turn of ~30), its text unlike any other's (a
    prefix cache must not shorten a prefill)."""
    words = [f"{seed}-{i}" for i in range(num_tokens)]
    while len(words) > 1:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        if len(ids) <= num_tokens:
            break
        words = words[:max(1, len(words) * num_tokens // len(ids) - 1)]
    return " ".join(words)


def write_dataset(path: Path, tokenizer, lengths: list[int], seed: int) -> Path:
    """A `bench serve --dataset` file: one prompt of about each of `lengths` tokens, each text
    met nowhere else in the run (`seed` apart)."""
    with open(path, "w") as file:
        for n, length in enumerate(lengths):
            file.write(json.dumps({"prompt": filler_prompt(tokenizer, length,
                                                           seed * 100_000 + n)}) + "\n")
    return path


def cycled(values: tuple[int, ...], count: int) -> list[int]:
    return [values[i % len(values)] for i in range(count)]


class Server:
    """`specserve serve` on a free port; `ready_s` from launch to /ready answering 200."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(self.port),
             "--log-level", "warning", *args], env={**os.environ, **env},
            stdout=open(log, "a"), stderr=subprocess.STDOUT)
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}): see {log}")
            time.sleep(0.1)
        self.ready_s = round(time.monotonic() - started, 2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def counters(self) -> dict:
        values = dict.fromkeys(COUNTERS, 0.0)
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(":", 1)[-1]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        return values

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def bench_serve(url: str, output: Path, *flags: str) -> dict:
    """One `specserve bench serve` run; its first run's first result (its figure may fail to
    draw where matplotlib is missing: the JSON is written before)."""
    subprocess.run([sys.executable, "-m", "specserve", "bench", "serve", "--base-url", url,
                    "--no-progress", "--output", str(output), *flags],
                   stdout=subprocess.DEVNULL, stderr=open(output.with_suffix(".log"), "w"),
                   timeout=300)
    return json.loads(output.read_text())["runs"][0]["results"]


def brief(result: dict) -> dict:
    return {"requests": result["completed"], "failed": result["failed"],
            "output_tokens_per_s": result["output_throughput"],
            "ttft_p50_ms": result["ttft_ms"]["p50"], "ttft_p99_ms": result["ttft_ms"]["p99"]}


def measure_served(server: Server, work: Path, n: dict, tokenizer) -> dict:
    """Every request's prompt is new to the server (no prefix-cache hit flatters a run)."""
    figures = {}

    def dataset_run(name: str, lengths: list[int], seed: int, *flags: str) -> dict:
        data = write_dataset(work / f"{name}.jsonl", tokenizer, lengths, seed)
        return brief(bench_serve(server.url, work / f"{name}.json", "--dataset", str(data),
                                 "--num-prompts", str(len(lengths)), *flags)[0])

    mixed = cycled(PROMPT_TOKENS, n["first_requests"])
    chat = ("--max-tokens", "64", "--concurrency", "8")
    first = dataset_run("first", mixed, 1, *chat)
    steady = dataset_run("steady", mixed, 2, *chat)
    figures["first_requests_after_ready"] = {
        "first": first, "steady": steady,
        "ttft_p99_ratio": round(first["ttft_p99_ms"] / steady["ttft_p99_ms"], 3)}
    figures["ttft_batch1_by_prompt_tokens"] = {
        str(length): dataset_run(f"ttft{length}", [length] * n["ttft_prompts"], 10 + i,
                                 "--max-tokens", "16", "--concurrency", "1")
        for i, length in enumerate(PROMPT_TOKENS)}
    wide = ("--ignore-eos", "--concurrency", str(n["concurrency"]),
            "--max-tokens", str(n["concurrent_tokens"]))
    lengths = cycled((64, 128, 256), n["concurrent_requests"])
    figures["concurrent"] = {
        "concurrency": n["concurrency"], "max_tokens": n["concurrent_tokens"],
        "first_round": dataset_run("wide1", lengths, 20, *wide),
        "steady": dataset_run("wide2", lengths, 21, *wide)}
    figures["after_ready_counters"] = server.counters()
    return figures


def agentic(server_args: str, work: Path, max_tokens: int) -> dict:
    output = work / "agentic.json"
    subprocess.run([sys.executable, "-m", "benchmarks.agentic", "--methods", "none,suffix",
                    "--offline", "none,suffix", "--workloads", "agent_loop,templated",
                    "--max-tokens", str(max_tokens), "--server-args", server_args,
                    "--log-dir", str(work), "--output", str(output)],
                   stdout=subprocess.DEVNULL, stderr=open(work / "agentic.log", "w"),
                   timeout=300)
    report = json.loads(output.read_text())
    keep = ("none_over_offline", "suffix_over_offline", "suffix_over_none")
    return {name: {**{k: v for k, v in result.items() if k in keep},
                   **{label: result[label]["tokens_per_s"]
                      for label in ("none", "suffix", "offline-none", "offline-suffix")}}
            for name, result in report["workloads"].items()}


def verdicts(report: dict) -> dict:
    """Issue 70's GPU targets, each True where the run met it (absent where it did not run)."""
    found = {}
    if "ttft_batch1_by_prompt_tokens" in report:
        found["ttft_p50_le_15ms_to_512_tokens"] = all(
            r["ttft_p50_ms"] <= 15 for r in report["ttft_batch1_by_prompt_tokens"].values())
        found["first_requests_ttft_p99_le_2x_steady"] = \
            report["first_requests_after_ready"]["ttft_p99_ratio"] <= 2
        steady = report["concurrent"]["steady"]
        found["concurrent_ge_25000_tok_s"] = steady["output_tokens_per_s"] >= 25_000
        found["concurrent_ttft_p50_le_50ms"] = steady["ttft_p50_ms"] <= 50
        found["no_first_use_after_ready"] = not any(report["after_ready_counters"].values())
    if "cold_start_to_ready_s" in report:
        found["cold_start_le_45s"] = report["cold_start_to_ready_s"] <= 45
    if "warm_start_to_ready_s" in report:
        found["warm_start_le_15s"] = report["warm_start_to_ready_s"] <= 15
    for name, result in report.get("agentic_batch1", {}).items():
        if name == "agent_loop":
            found["agent_loop_server_ge_0.8x_offline"] = result.get("none_over_offline", 0) >= 0.8
        found[f"{name}_suffix_ge_1.5x_none"] = result.get("suffix_over_none", 0) >= 1.5
    return found


def device_facts() -> dict:
    import torch

    facts = {"cpu": cpu_model(), "versions": our_versions()}
    try:
        import triton
        facts["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["versions"]["cuda"] = torch.version.cuda
    return facts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server-args", default="--dtype bfloat16 --device cuda")
    p.add_argument("--work", default="/tmp/serve70", help="bench outputs and server logs")
    p.add_argument("--scale", type=float, default=1.0, help="request counts x (dry runs)")
    p.add_argument("--skip-agentic", action="store_true")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model_folder

    server_args = args.server_args.split()
    model = server_args[server_args.index("--model") + 1] if "--model" in server_args else None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(model)[0])
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    n = counts(args.scale)
    env = {"TRITON_CACHE_DIR": str(work / "triton")}  # empty: a cold start compiles every kernel
    report = {"benchmark": "serve_check", "server_args": args.server_args, "scale": args.scale,
              **device_facts(), "errors": {}}

    def stage(name: str, measure) -> None:
        """Runs one part; a failure is recorded and the next part still runs (one lent GPU
        call), and the report so far is saved, should the call's time run out."""
        try:
            measure()
        except Exception as error:  # noqa: BLE001 - reported in the JSON, the run goes on
            report["errors"][name] = f"{type(error).__name__}: {error}"
        Path(args.output).write_text(json.dumps(report, indent=2))

    def served() -> None:
        server = Server(server_args, env, work / "server.log")
        report["cold_start_to_ready_s"] = server.ready_s
        try:
            report.update(measure_served(server, work, n, tokenizer))
        finally:
            server.stop()

    def restarted() -> None:
        server = Server(server_args, env, work / "server.log")  # the same kernel cache, full
        report["warm_start_to_ready_s"] = server.ready_s
        server.stop()

    stage("served", served)
    stage("warm_start", restarted)
    if not args.skip_agentic:
        stage("agentic", lambda: report.update(agentic_batch1=agentic(args.server_args, work,
                                                                      64)))
    report["targets_met"] = verdicts(report)
    emit(report, args.output)
    return report


if __name__ == "__main__":
    main()
