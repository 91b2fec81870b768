"""SIGTERM on a real server process with streams in flight: admission closes (503 with
Retry-After), readiness flips, in-flight streams finish or end with an explicit `finish_reason`
"abort" chunk, every KV block comes back, and the process exits 0 within the drain timeout. A
second signal exits at once."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from server.lifecycle import ABORT_GRACE_S
from tests.server.conftest import assert_error
from tests.servers import running_server, wait_until

DRAIN_TIMEOUT_S = 4
SHORT_TOKENS = 60  # finishes well inside the drain timeout
LONG_TOKENS = 7000  # cannot finish inside it: aborted at the deadline


@dataclass
class Stream:
    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    status: int | None = None
    events: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finished_at: float | None = None
    error: str | None = None


def _run_stream(base_url: str, stream: Stream) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": stream.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                          timeout=60) as response:
            stream.status = response.status_code
            for line in response.iter_lines():  # as they come: sse_events() reads to the end
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                stream.events.append(payload)
                if payload == "[DONE]":
                    continue
                choices = json.loads(payload).get("choices") or []
                if choices:
                    stream.started.set()
                    if choices[0]["finish_reason"] is not None:
                        stream.finish_reason = choices[0]["finish_reason"]
                        stream.finished_at = time.monotonic()
    except httpx.HTTPError as error:  # recorded; the test fails on it
        stream.error = repr(error)
    finally:
        stream.started.set()


@pytest.fixture
def server_log(tmp_path):
    with open(tmp_path / "server.log", "w+") as log:
        yield log


def _start(model_folder, log, *extra: str):
    args = ["--model", str(model_folder), "--served-model-name", "tiny",
            "--speculative-method", "none", "--max-num-seqs", "8", "--log-level", "info",
            "--drain-timeout", str(DRAIN_TIMEOUT_S),
            # Eager steps on a GPU too: the long request must outlast the drain's deadline, and
            # a graph-replayed tiny model could finish its LONG_TOKENS before it.
            "--enforce-eager", *extra]
    return running_server(args, "tiny", log_file=log)


def _start_streams(base_url: str, lengths: list[int]) -> tuple[list[Stream], list]:
    streams = [Stream(n) for n in lengths]
    threads = [threading.Thread(target=_run_stream, args=(base_url, s)) for s in streams]
    for thread in threads:
        thread.start()
    for stream in streams:
        assert stream.started.wait(60), "a stream never produced a token"
    return streams, threads



def test_sigterm_drains_eight_streams_and_exits_0(long_context_tiny_model, server_log):
    with _start(long_context_tiny_model, server_log) as server:
        url = server.base_url
        assert httpx.get(f"{url}/ready").json() == {"status": "ok"}
        streams, threads = _start_streams(url, [SHORT_TOKENS] * 4 + [LONG_TOKENS] * 4)
        assert all(s.finish_reason is None for s in streams), "a stream ended before SIGTERM"
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503, 10, "/ready to say 503")
        assert httpx.get(f"{url}/ready").json() == {"status": "draining"}
        health = httpx.get(f"{url}/health")  # alive: liveness must not kill a draining pod
        assert (health.status_code, health.json()) == (200, {"status": "draining"})
        refused = httpx.post(f"{url}/v1/completions", timeout=10,
                             json={"model": "tiny", "prompt": "late", "max_tokens": 4})
        assert_error(refused, 503, code="server_draining")
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/metrics").status_code == 200  # still scraped while draining

        returncode = server.process.wait(timeout=DRAIN_TIMEOUT_S + 3 * ABORT_GRACE_S + 10)
        exited = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=10)

    assert returncode == 0
    assert exited < DRAIN_TIMEOUT_S + 2 * ABORT_GRACE_S, exited
    for stream in streams:
        assert stream.error is None and stream.status == 200, stream
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        # An error event is a top-level "error" key; the sampled text itself may say "error".
        errors = [e for e in stream.events[:-1] if "error" in json.loads(e)]
        assert not errors, errors
        usage = json.loads(stream.events[-2])["usage"]
        assert usage["completion_tokens"] >= 1
        if stream.max_tokens == SHORT_TOKENS:  # finished normally, inside the drain
            assert stream.finish_reason == "length"
            assert usage["completion_tokens"] == SHORT_TOKENS
        else:  # cut at the deadline, with an explicit final chunk
            assert stream.finish_reason == "abort"
            assert usage["completion_tokens"] < LONG_TOKENS
            assert stream.finished_at - signalled >= DRAIN_TIMEOUT_S - 0.5
    assert any(s.finished_at > signalled for s in streams if s.max_tokens == SHORT_TOKENS)

    server_log.seek(0)
    log = server_log.read()
    (final,) = re.findall(r"final /metrics: (.*)", log)
    series = {line.rsplit(" ", 1)[0].split("{")[0].split(":")[-1]: float(line.rsplit(" ", 1)[1])
              for line in final.split("; ")}
    assert series["num_requests_running"] == 0 and series["num_requests_waiting"] == 0
    assert series["num_requests_queued"] == 0
    assert series["kv_cache_usage_perc"] == 0
    assert series["kv_cache_free_blocks"] == series["kv_cache_num_blocks"] > 0


def test_an_idle_server_exits_0_at_once(long_context_tiny_model, server_log):
    with _start(long_context_tiny_model, server_log) as server:
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 5


def test_a_second_signal_exits_at_once(long_context_tiny_model, server_log):
    with _start(long_context_tiny_model, server_log) as server:
        url = server.base_url
        _streams, threads = _start_streams(url, [LONG_TOKENS] * 2)
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503, 10, "/ready to say 503")
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        returncode = server.process.wait(timeout=10)
        assert time.monotonic() - signalled < 2
        for thread in threads:
            thread.join(timeout=10)
    assert returncode == 128 + signal.SIGINT


def test_a_non_streamed_request_cut_by_the_drain_comes_back_whole(long_context_tiny_model,
                                                                   server_log):
    with _start(long_context_tiny_model, server_log) as server:
        url = server.base_url
        answer: dict = {}

        def post() -> None:
            response = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG_TOKENS,
                "ignore_eos": True})
            answer["status"], answer["body"] = response.status_code, response.json()

        client = threading.Thread(target=post)
        client.start()
        wait_until(lambda: server.metrics()["num_requests_running"] == 1, 10, "one running request")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=DRAIN_TIMEOUT_S + 3 * ABORT_GRACE_S + 10) == 0
        client.join(timeout=10)
    assert answer["status"] == 200, answer
    (choice,) = answer["body"]["choices"]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert 0 < answer["body"]["usage"]["completion_tokens"] < LONG_TOKENS
