"""Real server processes on free loopback ports, started once and shared.

`server` serves the embedded default model with the default speculative method (what
`specserve serve` does with no arguments); `guarded_server` serves a tiny random model behind an API
key from the environment, with one batch slot and a queue of one (so busy-server paths are easy to
reach) and vLLM's metric names.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import make_tiny_model

API_KEY = "test-secret-key"
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


@pytest.fixture(scope="session")
def server():
    with running_server([], DEFAULT_MODEL) as running:
        yield running


@pytest.fixture(scope="session")
def long_context_tiny_model(tmp_path_factory, default_model_folder):
    """A tiny random Llama with the default tokenizer and room for thousands of tokens."""
    folder = tmp_path_factory.mktemp("tiny-long")
    make_tiny_model(folder, vocab_size=49152, tokenizer_from=default_model_folder,
                    eos_token_id=2, bos_token_id=1, max_position_embeddings=8192)
    return folder


@pytest.fixture(scope="session")
def guarded_server(long_context_tiny_model):
    args = ["--model", str(long_context_tiny_model), "--max-num-seqs", "1", "--max-queue", "1",
            "--speculative-method", "none", "--served-model-name", "tiny",
            "--metrics-prefix", "vllm"]
    with running_server(args, "tiny", env={"SPECSERVE_API_KEY": API_KEY},
                        metrics_prefix="vllm") as running:
        yield running


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    """The response is OpenAI's error envelope with this status; returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE stream, in order ("[DONE]" included)."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]
