"""The real server process on a loopback port: /health turns 200 once the model is loaded."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_starts_and_reports_health(tiny_chat_model_folder):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--model", str(tiny_chat_model_folder),
         "--port", str(port), "--log-level", "warning"],
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                status = httpx.get(f"{base}/health", timeout=2).status_code
                if status == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert status == 200, f"server did not become healthy (last status {status})"
        assert httpx.get(f"{base}/version").json()["version"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_bad_model_path_fails_fast_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--model", "/nonexistent/model",
         "--port", str(_free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "specserve: error: model path does not exist: /nonexistent/model")
