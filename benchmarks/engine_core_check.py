"""`--engine-core thread` against `--engine-core process` on one machine, in one run (issue 70):
two servers side by side; the same greedy outputs (one request at a time, so the batch is the
same); tokens/s at each concurrency by `specserve bench serve`, the servers taking turns; then the
engine process killed mid-stream (the stream's last event, /health, the exit status and how long
the server took to exit). Writes one JSON report; the device is named in it.

    python -m benchmarks.engine_core_check --output R.json [--server-args "--device cuda ..."]
        [--bench-args "--workload chat --concurrency 1,16,64 ..."]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a small village,"]
PID_LINE = re.compile(r"engine core in process (\d+)")


def start(mode: str, port: int, server_args: list[str], work: Path) -> subprocess.Popen:
    log = open(work / f"server_{mode}_{port}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port),
                             "--engine-core", mode, "--log-level", "info", *server_args],
                            stderr=log, stdout=log)


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 400) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"server on {port} exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"server on {port} not healthy after {timeout_s} s")


def greedy(port: int, prompt: str, stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": stream,
            "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]}
    url = f"http://127.0.0.1:{port}/v1/completions"
    if not stream:
        return httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def kill_mid_stream(port: int, process: subprocess.Popen, log_path: Path) -> dict:
    engine_pid = int(PID_LINE.search(log_path.read_text()).group(1))
    lines: list[str] = []

    def read():
        body = {"prompt": PROMPTS[3], "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True,
                "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while sum(line.startswith("data: ") for line in lines) < 3 and reader.is_alive():
        time.sleep(0.01)
    os.kill(engine_pid, signal.SIGKILL)
    killed = time.monotonic()
    reader.join(15)
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    except httpx.TransportError:
        health = "refused"
    try:
        status = process.wait(15)
    except subprocess.TimeoutExpired:
        status = None
    return {"stream_ended": not reader.is_alive(), "last_event": lines[-1] if lines else None,
            "health_after_kill": health, "server_exit_status": status,
            "seconds_to_exit": round(time.monotonic() - killed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--bench-args", default="--workload chat --num-prompts 32 "
                        "--max-tokens 128 --ignore-eos --concurrency 1,16")
    args = parser.parse_args()
    work = Path(args.output).parent
    server_args = shlex.split(args.server_args)
    servers = {}
    report: dict = {"server_args": server_args, "startup_s": {}}
    try:
        import torch

        report["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                            else "cpu")
        # One after the other: a GPU's memory profile at start would count the other's.
        for mode, port in (("thread", 8011), ("process", 8012)):
            servers[mode] = (port, start(mode, port, server_args, work))
            report["startup_s"][mode] = round(wait_healthy(port, servers[mode][1]), 1)
        outputs = {mode: [greedy(port, p, s) for p in PROMPTS for s in (False, True)]
                   for mode, (port, _) in servers.items()}
        report["greedy_identical"] = outputs["thread"] == outputs["process"]
        report["greedy_outputs"] = outputs
        bench_json = work / "bench.json"
        subprocess.run([sys.executable, "-m", "specserve", "bench", "serve", "--no-progress",
                        "--base-url", "http://127.0.0.1:8011", "--label", "thread",
                        "--base-url", "http://127.0.0.1:8012", "--label", "process",
                        "--output", str(bench_json), *shlex.split(args.bench_args)],
                       check=False, timeout=400)
        if bench_json.exists():
            report["bench"] = [
                {"label": run["label"], "concurrency": result["max_concurrency"],
                 "output_tok_s": result["output_throughput"], "ttft_ms": result["ttft_ms"],
                 "tpot_ms": result["tpot_ms"], "completed": result["completed"]}
                for run in json.loads(bench_json.read_text())["runs"]
                for result in run["results"]]
        port, process = servers["process"]
        report["kill"] = kill_mid_stream(port, process, work / f"server_process_{port}.log")
    finally:
        for _, process in servers.values():
            if process.poll() is None:
                process.terminate()
                process.wait(30)
        Path(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "greedy_outputs"}, indent=2))


if __name__ == "__main__":
    main()
