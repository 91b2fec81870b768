"""A server's footprint right after start: resident memory of the server and its chat template
workers, and the seconds from launch to /ready, for this tree and (with --baseline) an older
commit, taking turns.

    PYTHONPATH=. python -m benchmarks.server_footprint --baseline HEAD~3 --rounds 3 \
        --output benchmarks/results/server_footprint.json

Each tree starts `python -m server serve` with its default flags (plus --server-args) in its own
cache folder, so that neither rebuilds the other's C++ extensions. A first, untimed start per tree
builds them; then each round starts every tree once, in rotating order, waits until /ready
answers 200, lets it settle for --settle-s seconds, and records every process's resident memory
(VmRSS, and its anonymous, file-backed and shared parts); then it sends one JSON-schema request
(the grammar vocabulary is built on the first) and records its seconds, the event loop's longest
lag so far and the resident memory after it. Issue 49's target: at most 450 MB
(10^6 bytes) for the server and its workers together. MB here is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.agentic_servers import free_ports
from benchmarks.machine import ROOT, baseline_tree, cpu_model
from benchmarks.processes import tree_rss_bytes
from specserve.bench.server_state import server_state
from specserve.bench.report import emit, taking_turns

TARGET_MB = 450
STRUCTURED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}}}
STARTUP_TIMEOUT_S = 600


def start_and_measure(tree: Path, cache: Path, settle_s: float, server_args: list[str],
                      structured: bool = False) -> dict:
    """One start of the server in `tree`: seconds to /ready, then the resident memory of it and
    its descendants; with `structured`, then one JSON-schema request."""
    port = free_ports(1)[0]
    command = [sys.executable, "-m", "server", "serve", "--port", str(port),
               "--log-level", "warning", *server_args]
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    log = open(cache / "server.log", "w")
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=log)
    try:
        while not _ready(port):
            if process.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT_S:
                raise SystemExit(f"the server in {tree} did not start: see {cache}/server.log")
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        time.sleep(settle_s)
        memory = tree_rss_bytes(process.pid)
        first_structured = _first_structured_request(port, process.pid) if structured else {}
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
    return {"ready_s": round(ready_s, 2), **memory, **first_structured}


def _first_structured_request(port: int, pid: int) -> dict:
    """The first JSON-schema request's seconds (the grammar vocabulary is built on it), the
    event loop's longest lag so far (`/metrics`), and the resident memory after it."""
    started = time.monotonic()
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": STRUCTURED_SCHEMA}}})
    reply.raise_for_status()
    seconds = time.monotonic() - started
    state = server_state(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    return {"first_structured_s": round(seconds, 3),
            "loop_lag_max_le_s": state.get("loop_lag_max_le_s"),
            "rss_after_structured_bytes": tree_rss_bytes(pid)["rss_bytes"]}


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def summary(samples: list[dict]) -> dict:
    """Medians over the rounds: total and main-process resident MB, their parts, ready seconds."""
    def median_mb(values) -> float:
        return round(statistics.median(values) / 1e6, 1)

    main = [s["by_process"][0] for s in samples]
    return {"rss_mb": median_mb(s["rss_bytes"] for s in samples),
            "server_rss_mb": median_mb(m["rss"] for m in main),
            "server_anon_mb": median_mb(m["anon"] for m in main),
            "server_file_mb": median_mb(m["file"] for m in main),
            "server_shmem_mb": median_mb(m["shmem"] for m in main),
            "workers_rss_mb": median_mb(s["rss_bytes"] - m["rss"] for s, m in zip(samples, main)),
            "processes": statistics.median(s["processes"] for s in samples),
            "ready_s": round(statistics.median(s["ready_s"] for s in samples), 2),
            "first_structured_s": statistics.median(s["first_structured_s"] for s in samples),
            "rss_after_structured_mb": median_mb(s["rss_after_structured_bytes"]
                                                 for s in samples),
            "loop_lag_max_le_s": max((s["loop_lag_max_le_s"] for s in samples),
                                     key=lambda bound: float(bound or 0)),
            "within_target": statistics.median(s["rss_bytes"] for s in samples) <= TARGET_MB * 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="a commit to measure beside this tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--server-args", default="", help="more `specserve serve` flags")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    with baseline_tree(args.baseline) as baseline, tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": ROOT, **({f"baseline {args.baseline}": baseline} if baseline else {})}
        caches = {label: Path(scratch) / f"cache{i}" for i, label in enumerate(trees)}
        for label, tree in trees.items():  # builds the extensions, untimed
            caches[label].mkdir()
            start_and_measure(tree, caches[label], 0.0, args.server_args.split())
        commits = {label: _commit(tree) for label, tree in trees.items()}
        samples: dict[str, list[dict]] = {label: [] for label in trees}
        for round_index in range(args.rounds):
            for label in taking_turns(list(trees), round_index):
                sample = start_and_measure(trees[label], caches[label], args.settle_s,
                                           args.server_args.split(), structured=True)
                samples[label].append(sample)
                print(f"{label}: ready in {sample['ready_s']} s, "
                      f"{sample['rss_bytes'] / 1e6:.1f} MB", file=sys.stderr)
    emit({"benchmark": "server_footprint", "cpu": cpu_model(), "target_mb": TARGET_MB,
          "server_args": args.server_args, "rounds": args.rounds, "settle_s": args.settle_s,
          "commits": commits,
          "summary": {label: summary(s) for label, s in samples.items()},
          "samples": samples}, args.output)


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
