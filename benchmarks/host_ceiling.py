"""The host ceiling: tokens a second the whole server serves when the model's forward costs nothing.

Each tree's server starts with the benchmark-only stub forward (engine/runner/stub_runner.py,
`SPECSERVE_BENCHMARK_STUB_FORWARD=1`): scheduling, sampling, emit, detokenizing, delivery to the
event loop, SSE and the client all run as served; the model does not. The figure bounds what any
device reaches behind this host. `--baseline REF` checks REF out into a git worktree, copies the
stub into it (and its one-line hook into REF's engine, where REF lacks it), so an older server is
measured through the same stub. Both servers stay up; each round sends `--num-requests` streamed
chat requests of `--max-tokens` tokens (EOS ignored, greedy) at `--concurrency`, the trees taking
turns in alternating order. The load generator is the project's (`specserve bench serve`'s
run_load), in this process: it shares the host's cores with the server, as a client on the same
machine does. Each round reports the server's and the client's CPU seconds per 1k tokens and
SSE chunks per token; then each tree's engine alone runs the same batch through the stub, with no
server (`engine_alone_tokens_per_s`: what a front that cost nothing would reach). Prints JSON;
run it alone on the machine:

    flock /tmp/specserve-bench.lock .venv/bin/python -m benchmarks.host_ceiling \\
        --baseline 40bdf22 --output benchmarks/results/host_ceiling_<cpu>_<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from benchmarks.machine import ROOT, baseline_tree, cpu_model, our_versions
from specserve.bench.load import RequestOptions, Target, run_load
from specserve.bench.serving_metrics import distribution_ms, output_digest
from specserve.bench.workloads import Workload

STUB_FILE = Path("engine/runner/stub_runner.py")
STUB_ENV = "SPECSERVE_BENCHMARK_STUB_FORWARD"
# The engine line the stub's hook replaces in a tree that predates it.
MODEL_RUNNER_LINE = "        self.runner = ModelRunner(loaded.model, kv_cache, self.device)\n"
HOOK_LINE = "        self.runner = flat_runner(config, loaded, kv_cache, self.device)  # stub\n"
HOOK_IMPORT = "from engine.runner.stub_runner import flat_runner\n"
STARTUP_TIMEOUT_S = 300


def install_stub(tree: Path) -> None:
    """Copies this tree's stub into `tree` and, where `tree`'s engine builds its flat runner
    without the hook, puts the hook there. Raises RuntimeError where neither line is found."""
    shutil.copyfile(ROOT / STUB_FILE, tree / STUB_FILE)
    engine_file = tree / "engine" / "engine.py"
    text = engine_file.read_text()
    if "flat_runner(" in text:
        return
    if MODEL_RUNNER_LINE not in text:
        raise RuntimeError(f"{engine_file}: no line building the flat runner to hook the stub to")
    text = text.replace(MODEL_RUNNER_LINE, HOOK_LINE)
    text = text.replace("from engine.runner.model_runner import ModelRunner\n",
                        "from engine.runner.model_runner import ModelRunner  # noqa: F401\n"
                        + HOOK_IMPORT)
    if HOOK_IMPORT not in text:
        raise RuntimeError(f"{engine_file}: no ModelRunner import to put the stub's beside")
    engine_file.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def stub_server(tree: Path, server_args: list[str]):
    """The server of `tree` (its own code first on the import path) with the stub forward, on a
    free port; yields (base URL, process)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
         *server_args],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), STUB_ENV: "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server of {tree} exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server of {tree} was not healthy in time")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base_url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children (template workers), in seconds."""
    import psutil

    process = psutil.Process(pid)
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def workloads(num_requests: int) -> list[Workload]:
    return [Workload(f"host/{i}", "host", f"Tell me story number {i} about a lighthouse keeper "
                     "and her cat, in plain words.", chat=True) for i in range(num_requests)]


def summarize_round(records, duration: float, server_cpu_s: float, client_cpu_s: float) -> dict:
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    chunks = sum(len(r.chunk_times) for r in done)
    return {
        "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": round(duration, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration, 1),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls]),
        "chunks_per_token": round(chunks / tokens, 4) if tokens else None,
        "server_cpu_s_per_1k_tokens": round(1000 * server_cpu_s / tokens, 3) if tokens else None,
        "client_cpu_s_per_1k_tokens": round(1000 * client_cpu_s / tokens, 3) if tokens else None,
        "digests": [output_digest(r.text) for r in done],
    }


async def measure(servers: dict[str, tuple[str, int]], args) -> dict[str, list[dict]]:
    """Rounds by tree, the trees taking turns (in alternating order), after a warm-up round
    each (first requests pay one-time costs: connections, templates, allocations)."""
    options = RequestOptions("chat", args.max_tokens, temperature=0.0, ignore_eos=True)
    items = workloads(args.num_requests)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=None)
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        targets = {name: Target(name, url, "") for name, (url, _) in servers.items()}
        models = {}
        for name, target in targets.items():
            listed = (await client.get(f"{target.base_url}/v1/models")).json()["data"]
            models[name] = Target(name, target.base_url, listed[0]["id"])
        for name, target in models.items():
            await run_load(client, target, items, options, args.concurrency, float("inf"), 0)
        for turn in range(args.repeats):
            order = list(models) if turn % 2 == 0 else list(models)[::-1]
            for name in order:
                pid = servers[name][1]
                cpu_before, client_before = cpu_seconds(pid), time.process_time()
                records, duration = await run_load(client, models[name], items, options,
                                                   args.concurrency, float("inf"), 0)
                rounds[name].append(summarize_round(records, duration,
                                                    cpu_seconds(pid) - cpu_before,
                                                    time.process_time() - client_before))
    return rounds


def engine_alone(args) -> dict:
    """Runs in whichever tree is on sys.path: its engine through the stub, with no server (the
    most the server could reach with a front that cost nothing), best of `--repeats`."""
    os.environ[STUB_ENV] = "1"
    from engine import LLM, SamplingParams

    llm = LLM(args.model, speculative_method="none", device="cpu", kv_cache_memory_gib=2,
              max_num_seqs=args.concurrency)
    prompts = [w.text for w in workloads(args.concurrency)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        llm.generate(prompts, params)
        best = min(best, time.perf_counter() - started)
    return {"engine_alone_tokens_per_s": round(len(prompts) * args.max_tokens / best, 1)}


def engine_alone_in(tree: Path, args) -> dict:
    from benchmarks.machine import measure_in_tree

    return measure_in_tree(Path(__file__).resolve(), tree, [
        "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
        "--repeats", str(args.repeats), *(["--model", args.model] if args.model else [])])


def median_cell(rounds: list[dict]) -> dict:
    def median(path):
        values = list(rounds)
        for key in path:
            values = [v[key] for v in values]
        return round(statistics.median(values), 3) if None not in values else None
    return {"output_tokens_per_s": median(["output_tokens_per_s"]),
            "ttft_p50_ms": median(["ttft_ms", "p50"]), "ttft_p99_ms": median(["ttft_ms", "p99"]),
            "itl_p50_ms": median(["itl_ms", "p50"]),
            "chunks_per_token": median(["chunks_per_token"]),
            "server_cpu_s_per_1k_tokens": median(["server_cpu_s_per_1k_tokens"]),
            "client_cpu_s_per_1k_tokens": median(["client_cpu_s_per_1k_tokens"]),
            "failed": sum(r["failed"] for r in rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to measure beside this tree (e.g. 40bdf22)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64, help="requests a round")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per tree")
    parser.add_argument("--model", default=None, help="the server's --model (default: its own)")
    parser.add_argument("--this-args", default="",
                        help="more server flags for this tree only, e.g. '--engine-core process' "
                             "(a baseline tree may not know them)")
    parser.add_argument("--output")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:  # in a tree's subprocess (engine_alone_in)
        print(json.dumps(engine_alone(args)))
        return
    server_args = ["--speculative-method", "none", "--max-num-seqs", str(args.concurrency),
                   "--device", "cpu", "--kv-cache-memory", "2",
                   *(["--model", args.model] if args.model else [])]
    with baseline_tree(args.baseline) as baseline, ExitStack() as stack:
        trees = {"this": ROOT, **({"baseline": baseline} if baseline else {})}
        if baseline is not None:
            install_stub(baseline)
        servers = {}
        for name, tree in trees.items():
            extra = shlex.split(args.this_args) if name == "this" else []
            url, process = stack.enter_context(stub_server(tree, [*server_args, *extra]))
            servers[name] = (url, process.pid)
        rounds = asyncio.run(measure(servers, args))
        alone = {name: engine_alone_in(tree, args) for name, tree in trees.items()}
    result = {
        "benchmark": "host_ceiling",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "versions": our_versions(),
                    "note": "the load generator runs on the same cores as the server"},
        "config": {"concurrency": args.concurrency, "num_requests": args.num_requests,
                   "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "baseline": args.baseline, "server_args": server_args,
                   "this_args": args.this_args,
                   "endpoint": "chat, streamed, ignore_eos, greedy", "stub": STUB_ENV + "=1"},
        "median": {name: {**median_cell(r), **alone[name]} for name, r in rounds.items()},
        "rounds": {name: [{k: v for k, v in r.items() if k != "digests"} for r in rs]
                   for name, rs in rounds.items()},
    }
    digests = {name: rs[0]["digests"] for name, rs in rounds.items()}
    result["outputs_agree_across_trees_and_rounds"] = all(
        r["digests"] == digests["this"] for rs in rounds.values() for r in rs)
    if "baseline" in rounds:
        this, base = result["median"]["this"], result["median"]["baseline"]
        result["this_over_baseline_tokens_per_s"] = round(
            this["output_tokens_per_s"] / base["output_tokens_per_s"], 2)
    from specserve.bench.report import emit

    emit(result, args.output, indent=2)


if __name__ == "__main__":
    main()
