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


def wait_until(predicate, timeout: float, what: str, every: float = 0.05):
    """Polls `predicate` until it returns something truthy, and returns that; fails naming `what`
    after `timeout` seconds. Tests wait on the event itself, never on a fixed sleep that stands
    in for it: a faster or slower machine then changes only how long the wait takes."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)
    return result


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


def engine_test_args(args: list[str]) -> list[str]:
    """What `make_llm` gives in-process engines, as flags for a server (a test's own `args`
    come after them and win): the test device, float32, and a fixed KV budget, so servers and
    engines share a GPU in one test run."""
    from tests.conftest import TEST_DEVICE, TEST_KV_CACHE_GIB

    defaults = ["--device", str(TEST_DEVICE), "--dtype", "float32"]
    if "--gpu-memory-utilization" not in args:
        defaults += ["--kv-cache-memory", str(TEST_KV_CACHE_GIB)]
    return defaults


@contextmanager
def running_server(args: list[str], model: str, env: dict[str, str] | None = None,
                   metrics_prefix: str = "specserve", log_file=None, prefix: list[str] = ()):
    """`log_file`: an open file for the server's stderr (its log), else the test's stderr;
    `prefix`: a command the server runs under (`prlimit --nofile=...`)."""
    port = free_port()
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
         *engine_test_args(args), *args],
        env={**os.environ, **(env or {})}, stderr=log_file,
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


@contextmanager
def running_prometheus(config_text: str, folder, unchecked: str):
    """A real Prometheus with this config on a free loopback port, its data under `folder`; yields
    its base URL once ready. Where Prometheus is not installed the calling test skips, saying
    what then goes `unchecked`."""
    import shutil

    import pytest

    if shutil.which("prometheus") is None:
        pytest.skip(f"Prometheus is not installed (`make test` installs Debian's package "
                    f"`prometheus` where it can): {unchecked}")

    config = folder / "prometheus.yml"
    config.write_text(config_text)
    port = free_port()
    process = subprocess.Popen(
        [shutil.which("prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, "prometheus not ready"
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def prometheus_query(url: str, expr: str) -> list:
    """The result vector of an instant query; asserts the query itself is valid."""
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]
