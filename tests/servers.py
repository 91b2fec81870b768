"""Real specserve server processes on free loopback ports, for tests of every package."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen
    model: str
    metrics_prefix: str = "specserve"

    def metrics(self) -> dict[str, float]:
        """Series name (prefix removed) -> value from /metrics, summed over label sets."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name = series.split("{", 1)[0].removeprefix(f"{self.metrics_prefix}:")
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_until_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Polls /metrics until no request runs, waits or holds a KV block."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (metrics["num_requests_running"] == 0
                    and metrics["num_requests_waiting"] == 0
                    and metrics["num_requests_queued"] == 0
                    and metrics["kv_cache_usage_perc"] == 0
                    and metrics["kv_cache_free_blocks"] == metrics["kv_cache_num_blocks"])
            if idle:
                return metrics
            assert time.monotonic() < deadline, f"server still busy: {metrics}"
            time.sleep(0.05)


@contextmanager
def running_server(args: list[str], model: str, env: dict[str, str] | None = None,
                   metrics_prefix: str = "specserve"):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
         *args],
        env={**os.environ, **(env or {})},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        status = None
        while status != 200:
            assert process.poll() is None, f"server exited with {process.returncode}"
            assert time.monotonic() < deadline, f"server not healthy (last status {status})"
            try:
                status = httpx.get(f"{base_url}/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.2)
        yield RunningServer(base_url, process, model, metrics_prefix)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
