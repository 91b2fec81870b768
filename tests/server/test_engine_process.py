"""The engine core in its own process (`--engine-core process`, engine/core_process/) against the
in-thread engine (`--engine-core thread`): the same greedy outputs through HTTP, streamed and
not; an engine process that dies fails every request in flight and ends the server; an abort or
a disconnect frees the engine's KV blocks."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.server.stream_kill import kill_under_a_stream
from tests.servers import DEFAULT_MODEL, running_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a small village,"]
CHAT = [{"role": "user", "content": "Name two planets."}]
PID_LINE = re.compile(r"engine core in process (\d+)")


@pytest.fixture(scope="module")
def thread_server():
    with running_server(["--engine-core", "thread"], DEFAULT_MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def process_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("engine-process") / "server.log"
    with open(log_path, "w") as log, running_server(
            ["--engine-core", "process", "--log-level", "info"], DEFAULT_MODEL,
            log_file=log) as server:
        server.log_path = log_path
        yield server


def _completion(server, prompt: str, stream: bool, **extra) -> tuple[str, str]:
    """(text, finish reason) of a greedy completion, read whole or from its events."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "stream": stream, **extra}
    url = f"{server.base_url}/v1/completions"
    if not stream:
        choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, reason = "", None
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for event in _events(response):
            choice = event["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


def _chat(server, stream: bool) -> str:
    body = {"model": server.model, "messages": CHAT, "max_tokens": 24, "temperature": 0,
            "stream": stream}
    url = f"{server.base_url}/v1/chat/completions"
    if not stream:
        return httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        return "".join(event["choices"][0]["delta"].get("content") or ""
                       for event in _events(response) if event.get("choices"))


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def test_greedy_outputs_are_identical_in_both_modes(thread_server, process_server):
    for prompt in PROMPTS:
        for stream in (False, True):
            expected = _completion(thread_server, prompt, stream)
            assert expected[0], prompt
            assert _completion(process_server, prompt, stream) == expected, (prompt, stream)
    for stream in (False, True):
        assert _chat(process_server, stream) == _chat(thread_server, stream)
    # Negative control: the comparison sees a difference where there is one.
    shorter = _completion(process_server, PROMPTS[0], False, max_tokens=8)
    assert shorter != _completion(thread_server, PROMPTS[0], False)
    sampled = _completion(process_server, PROMPTS[3], False, temperature=1.5, seed=7)
    assert sampled != _completion(thread_server, PROMPTS[3], False)


def test_process_mode_reports_engine_metrics(process_server):
    """The engine's stat listeners run in the API process, fed by each step's message."""
    before = process_server.metrics()
    _completion(process_server, PROMPTS[1], True)
    after = process_server.wait_until_idle()
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 24
    assert after["request_success_total"] - before["request_success_total"] == 1
    assert after["kv_cache_num_blocks"] > 0


def test_abort_and_disconnect_free_kv_blocks_in_process_mode(process_server):
    body = {"model": process_server.model, "prompt": PROMPTS[3], "max_tokens": 2000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{process_server.base_url}/v1/completions", json=body,
                      timeout=120) as response:
        events = _events(response)
        for _ in range(3):
            next(events)
        # Negative control: while the stream runs, the engine holds its blocks.
        busy = process_server.metrics()
        assert busy["kv_cache_free_blocks"] < busy["kv_cache_num_blocks"]
        assert busy["num_requests_running"] == 1
    process_server.wait_until_idle()  # the client left: aborted, blocks freed
    # A response that is not streamed, its client gone before the end.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{process_server.base_url}/v1/completions", json=body, timeout=1.5)
    process_server.wait_until_idle()


def test_killed_engine_process_fails_streams_and_ends_the_server(tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log, running_server(
            ["--engine-core", "process", "--log-level", "info"], DEFAULT_MODEL,
            log_file=log) as server:
        engine_pid = int(PID_LINE.search(log_path.read_text()).group(1))
        assert engine_pid != server.process.pid
        killed_at = kill_under_a_stream(server, PROMPTS[3], 2000, engine_pid, 3,
                                        "the engine process")
        try:
            health = httpx.get(f"{server.base_url}/health", timeout=5)
            assert health.status_code == 503
            assert health.json() == {"status": "engine_dead"}
        except httpx.TransportError:
            pass  # already gone
        returncode = server.process.wait(timeout=10)
        assert returncode != 0
        assert time.monotonic() - killed_at < 10
