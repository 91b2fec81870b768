"""The real server process on a loopback port: /health turns 200 once the model is loaded."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.servers import free_port, running_server


def test_server_starts_and_reports_health(tiny_chat_model_folder):
    with running_server(["--model", str(tiny_chat_model_folder)], "tiny") as server:
        assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
        assert httpx.get(f"{server.base_url}/version").json()["version"]
        models = httpx.get(f"{server.base_url}/v1/models").json()
        assert models["data"][0]["id"] == tiny_chat_model_folder.name


def test_bad_model_path_fails_fast_with_one_line():
    # `python -m server` without the subcommand means `serve`.
    result = subprocess.run(
        [sys.executable, "-m", "server", "--model", "/nonexistent/model",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "specserve: error: model path does not exist: /nonexistent/model")


def test_an_engine_that_cannot_start_fails_with_one_line(tiny_chat_model_folder):
    """Errors found while the engine starts (here a KV budget of not even one block; on a GPU, a
    --gpu-memory-utilization the card cannot give) end the process with one line."""
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--model", str(tiny_chat_model_folder),
         "--kv-cache-memory", "1e-9", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("specserve: error: the KV cache budget of 0.000 GiB holds not even "
                           "one block"), result.stderr
    assert "Traceback" not in result.stderr
