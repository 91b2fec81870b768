"""Issue 29's targets, measured against the default server (`specserve serve`, default flags, the
embedded model) started by this script:

- amplification: the 300 prompts x n=128 request is refused (how fast), and a normal client's p50
  latency with and without the attacker beside it, in alternating phases;
- disconnects: 1,000 clients leaving at random moments (streamed or not, n 1 or 2) under load;
  then 5xx answers, tracebacks in the log, KV blocks in use;
- flood: 20,000 idle sockets; how long /health takes to answer, log and RSS growth.

    python -m benchmarks.hostile [--disconnects 1000] [--sockets 20000] [--output F]

Prints one JSON report. The startup figure (a GGUF claiming 2^32-1 positions) is measured by
tests/server/test_disconnects.py's malicious-GGUF test.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx

from benchmarks.machine import cpu_model
from specserve.bench.report import emit
from specserve.bench.server_state import server_state
from benchmarks.vs_llamacpp import free_ports, wait_ready

NORMAL = {"prompt": "Write a haiku about the sea.", "max_tokens": 16, "temperature": 0}
ATTACK = {"prompt": ["x"] * 300, "n": 128, "max_tokens": 16}


def rss_kib(pid: int) -> int:
    """The process and its children (the chat-template renderers)."""
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], text=True,
                                                    capture_output=True).stdout.split()]
    total = 0
    for one in pids:
        try:
            with open(f"/proc/{one}/status") as status:
                total += next(int(line.split()[1]) for line in status
                              if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _timed(client: httpx.Client, url: str, body: dict) -> tuple[int, float]:
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    return response.status_code, time.perf_counter() - started


def amplification(url: str, phases: int, phase_s: float, attack_rate: float) -> dict:
    """Alternating quiet and attacked phases, so the host's drift falls on both alike. The
    attacker is a thread of its own, `attack_rate` requests a second, so its client work does
    not sit in the normal client's loop."""
    normal = {"quiet": [], "attacked": []}
    refusals: list[tuple[int, float]] = []
    with httpx.Client(timeout=60) as client, httpx.Client(timeout=60) as attacker_client:
        for phase in range(2 * phases):
            kind = "attacked" if phase % 2 else "quiet"
            stop = time.perf_counter() + phase_s

            def attacker():
                while time.perf_counter() < stop:
                    refusals.append(_timed(attacker_client, url, ATTACK))
                    time.sleep(1 / attack_rate)

            thread = threading.Thread(target=attacker) if kind == "attacked" else None
            if thread is not None:
                thread.start()
            while time.perf_counter() < stop:
                status, seconds = _timed(client, url, NORMAL)
                if status == 200:
                    normal[kind].append(seconds)
            if thread is not None:
                thread.join()
    quiet, attacked = (statistics.median(normal[k]) for k in ("quiet", "attacked"))
    return {"attack_requests": len(refusals), "attack_rate_per_s": attack_rate,
            "attack_statuses": sorted({status for status, _ in refusals}),
            "refused_in_ms_p50": round(1e3 * statistics.median(s for _, s in refusals), 2),
            "refused_in_ms_max": round(1e3 * max(s for _, s in refusals), 2),
            "normal_p50_ms_quiet": round(1e3 * quiet, 1),
            "normal_p50_ms_attacked": round(1e3 * attacked, 1),
            "normal_p50_change": round(attacked / quiet - 1, 4),
            "normal_requests": {k: len(v) for k, v in normal.items()}}


async def _leave(client: httpx.AsyncClient, url: str, rng: random.Random) -> bool:
    """One client that hangs up after a random delay: streamed or not, chat or completions.
    False when its response was whole before the delay ran out."""
    body = {"max_tokens": 200, "ignore_eos": True, "n": rng.choice([1, 2]),
            "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", "Tell me about " + str(rng.random())
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user",
                                                           "content": str(rng.random())}]
    try:
        async with asyncio.timeout(rng.uniform(0, 1.0)):
            async with client.stream("POST", f"{url}{path}", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
    except TimeoutError:
        return True  # the client left: its connection was closed
    return False


async def disconnects(url: str, count: int, concurrency: int) -> dict:
    rng = random.Random(0)
    slots = asyncio.Semaphore(concurrency)

    async def one(client) -> bool:
        async with slots:
            return await _leave(client, url, rng)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as client:
        left = sum(await asyncio.gather(*(one(client) for _ in range(count))))
        elapsed = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while True:
            state = server_state((await client.get(f"{url}/metrics")).text)
            if state.get("kv_cache_usage_perc", 1) == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    return {"clients": count, "left_before_the_end": left, "concurrency": concurrency, "seconds": round(elapsed, 1),
            "kv_cache_usage_after": state.get("kv_cache_usage_perc"),
            "requests_running_after": state.get("num_requests_running")}


def _hold_sockets(host: str, port: int, count: int, ready, release) -> None:
    """In a child process (one process may hold fewer descriptors than the flood needs):
    `count` non-blocking connects that never send a byte, held until `release` is set."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, port))
        sockets.append(sock)
    ready.set()
    release.wait()


def flood(url: str, host: str, port: int, count: int, pid: int, log: Path) -> dict:
    """`count` sockets that connect and send nothing, from as many child processes as the
    descriptor limit asks; then /health, timed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_process = max(1, hard - 512)
    context = multiprocessing.get_context("fork")  # no threads are left at this point
    release = context.Event()
    rss_before, log_before = rss_kib(pid), log.stat().st_size
    started = time.monotonic()
    holders, readies = [], []
    for first in range(0, count, per_process):
        ready = context.Event()
        holders.append(context.Process(target=_hold_sockets, daemon=True, args=(
            host, port, min(per_process, count - first), ready, release)))
        readies.append(ready)
        holders[-1].start()
    try:
        for ready in readies:
            ready.wait(timeout=120)
        opened_s = time.monotonic() - started
        health_started = time.monotonic()
        status = None
        while status != 200 and time.monotonic() - health_started < 60:
            try:
                status = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
        health_s = time.monotonic() - health_started
        rss_during = rss_kib(pid)
    finally:
        release.set()
        for holder in holders:
            holder.join(timeout=30)
    return {"sockets": count, "client_processes": len(holders),
            "opened_in_s": round(opened_s, 2),
            "health_answered_in_s": round(health_s, 2), "health_status": status,
            "rss_growth_mb": round((rss_during - rss_before) / 1024, 1),
            "log_growth_bytes": log.stat().st_size - log_before,
            "accept_error_lines": log.read_text(errors="replace").count("accept errors so far"),
            "server_file_limit": _logged_file_limit(log)}


def _logged_file_limit(log: Path) -> str | None:
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if "file descriptors" in line]
    return lines[0].split(": ", 2)[-1] if lines else None


def five_hundreds(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specserve:http_requests_total") and 'status="5' in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disconnects", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sockets", type=int, default=20_000)
    parser.add_argument("--phases", type=int, default=3, help="quiet/attacked pairs")
    parser.add_argument("--phase-seconds", type=float, default=8.0)
    parser.add_argument("--attack-rate", type=float, default=10.0,
                        help="300 x 128 requests a second during attacked phases")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "server.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port)],
                                   stdout=log_file, stderr=log_file)
        try:
            wait_ready([(f"{url}/ready", process.pid)])
            report = {"benchmark": "hostile", "date": date.today().isoformat(),
                      "cpu": cpu_model(), "server": "specserve serve (defaults)"}
            report["amplification"] = amplification(url, args.phases, args.phase_seconds,
                                                    args.attack_rate)
            before = five_hundreds(url)
            report["disconnects"] = asyncio.run(disconnects(url, args.disconnects,
                                                            args.concurrency))
            report["disconnects"]["five_hundreds"] = five_hundreds(url) - before
            report["flood"] = flood(url, "127.0.0.1", port, args.sockets, process.pid, log)
            text = log.read_text(errors="replace")
            report["log"] = {"bytes": len(text), "tracebacks": text.count("Traceback")}
        finally:
            process.terminate()
            process.wait(timeout=60)
    emit(report, args.output)


if __name__ == "__main__":
    main()
