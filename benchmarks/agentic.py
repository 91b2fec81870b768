"""Suffix decoding against ngram and none on agentic and repetitive traffic, through the server.

    PYTHONPATH=. python -m benchmarks.agentic --output benchmarks/results/agentic_<cpu>.json

One `specserve serve` per method (the default model, defaults otherwise), all started first and
then fed the same turns at batch 1, the methods taking turns on every request (whoever goes
first on a machine runs a little slower). Workloads (benchmarks/agentic_workloads.py): an agent
loop re-sending its history, one template over different inputs, one prompt repeated at T = 0
and at T = 0.7 (seeded), and fresh chat as the control. Per workload and method: completion
tokens per second over all its requests, acceptance from `usage.speculative`, and the ratios
suffix/none and suffix/ngram. Greedy and seeded outputs must agree across methods (lossless);
the report says whether they did. The machine's load (`uptime`) is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.agentic_workloads import Workload, all_workloads
from benchmarks.machine import cpu_model, our_versions
from specserve.bench.report import emit, taking_turns

METHODS = ("none", "ngram", "suffix")
STARTUP_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(methods: list[str], extra: list[str], log_dir: Path) -> dict[str, str]:
    """method -> base URL, each server healthy; the processes end with this one (atexit)."""
    urls, processes = {}, []
    for method in methods:
        port = _free_port()
        log = open(log_dir / f"agentic_{method}.log", "w")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level",
             "warning", "--speculative-method", method, *extra],
            stderr=log, stdout=log, env=os.environ.copy()))
        urls[method] = f"http://127.0.0.1:{port}"
    import atexit

    atexit.register(lambda: [p.terminate() for p in processes])
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for method, url in urls.items():
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise SystemExit(f"the {method} server did not start: see {log_dir}")
            time.sleep(0.5)
    return urls


def chat(url: str, system: str | None, messages: list[dict], max_tokens: int,
         temperature: float, seed: int | None) -> tuple[dict, float]:
    body = {"max_tokens": max_tokens, "temperature": temperature,
            "messages": ([{"role": "system", "content": system}] if system else []) + messages}
    if seed is not None:
        body["seed"] = seed
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return response.json(), seconds


def run_workload(workload: Workload, urls: dict[str, str], max_tokens: int) -> dict:
    methods = list(urls)
    totals = {m: {"tokens": 0, "seconds": 0.0, "draft": 0, "accepted": 0} for m in methods}
    histories = {m: [] for m in methods}
    identical, request_index = True, 0
    for episode in workload.episodes:
        histories = {m: [] for m in methods}
        for turn in episode:
            texts = {}
            for method in taking_turns(methods, request_index):
                messages = (histories[method] if turn.history else []) + \
                    [{"role": "user", "content": turn.user}]
                body, seconds = chat(urls[method], workload.system, messages, max_tokens,
                                     turn.temperature, turn.seed)
                text = body["choices"][0]["message"]["content"] or ""
                usage = body["usage"]
                total = totals[method]
                total["tokens"] += usage["completion_tokens"]
                total["seconds"] += seconds
                total["draft"] += usage["speculative"]["draft_tokens"]
                total["accepted"] += usage["speculative"]["accepted_tokens"]
                histories[method] = messages + [{"role": "assistant", "content": text}]
                texts[method] = text
            identical &= len(set(texts.values())) == 1
            request_index += 1
    result = {"requests": request_index, "outputs_identical_across_methods": identical}
    for method, total in totals.items():
        result[method] = {
            "completion_tokens": total["tokens"], "seconds": round(total["seconds"], 3),
            "tokens_per_s": round(total["tokens"] / total["seconds"], 2),
            "draft_tokens": total["draft"], "accepted_tokens": total["accepted"],
            "acceptance_rate": round(total["accepted"] / total["draft"], 3)
            if total["draft"] else None}
    rate = {m: result[m]["tokens_per_s"] for m in methods}
    for other in ("none", "ngram"):
        if "suffix" in rate and other in rate:
            result[f"suffix_over_{other}"] = round(rate["suffix"] / rate[other], 3)
    return result


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scale", type=int, default=1, help="episodes per workload, x")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `specserve serve` flags")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--cpu-note", default=None, help="what to say of the CPU beside its name")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    load_before = _load()
    urls = start_servers(args.methods.split(","), args.server_args.split(), Path(args.log_dir))
    workloads = {}
    for workload in all_workloads(args.seed, args.scale):
        workloads[workload.name] = run_workload(workload, urls, args.max_tokens)
        print(f"{workload.name}: {workloads[workload.name]}", file=sys.stderr)
    emit({"benchmark": "agentic", "cpu": cpu_model(), "cpu_note": args.cpu_note,
          "versions": our_versions(), "batch": 1, "max_tokens": args.max_tokens,
          "scale": args.scale, "server_args": args.server_args,
          "load_before": load_before, "load_after": _load(), "workloads": workloads},
         args.output)


if __name__ == "__main__":
    main()
