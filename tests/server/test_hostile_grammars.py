"""Grammars as an attack surface (issue 48), against a real server: while each hostile body is
refused or served, `/health` answers within 0.5 s and the event loop is never held past
LOOP_LAG_BOUND_S (the server's own `event_loop_lag_seconds`; the checks and the compilation run
off the event loop); a grammar past the grammar engine's limits is a 400 naming its parameter, within
1 s; a grammar that fails after admission is an error, never text it forbids.

The latency probe's negative control stops the server process (SIGSTOP) while probing: a loop
that cannot answer is seen, by the probe and by the loop's own lag histogram."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from specserve.bench.server_state import loop_lag_buckets
from tests.server.conftest import assert_error, sse_events

HEALTH_BOUND_S = 0.5
# The bound is 50 ms; on the Xeon no hostile body held the loop past 50 ms (the served
# 95 KB schema, generating under its grammar, came closest: 25-50 ms). The test allows 250 ms (a
# histogram bucket bound), for the slowest CI machines and their neighbours: what it must catch
# is a body that holds the loop for its whole parse or compile (1.4 s for a 95 KB schema before).
LOOP_LAG_BOUND_S = 0.25
PROBE_EVERY_S = 0.05


@contextmanager
def health_probe(base_url: str):
    """Probes /health every 50 ms on its own connection while the block runs; yields a list
    that holds, afterwards, every probe's latency in seconds (a failed probe counts as inf)."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    ok = client.get(f"{base_url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.monotonic() - started if ok else float("inf"))
                stop.wait(PROBE_EVERY_S)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.2)  # probes already running when the body arrives
    try:
        yield latencies
    finally:
        time.sleep(0.2)  # and after it has been answered
        stop.set()
        thread.join(timeout=30)


def loop_lags(base_url: str) -> dict[float, float]:
    """The server's event-loop lag histogram: wake-ups at or under each bucket bound."""
    return loop_lag_buckets(httpx.get(f"{base_url}/metrics").text)


def _schema_body(schema: dict) -> dict:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def _completion_body(structured: dict) -> dict:
    return {"model": "tiny", "prompt": "Answer:", "max_tokens": 8, "temperature": 0,
            "structured_outputs": structured}


OPTIONAL_20K = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                 for i in range(20_000)}}
# About 95 KB, under the 100,000-character limit: all required (it compiles and is served) or all
# optional (past the grammar engine's row limit: refused before compiling).
REQUIRED_95K = {"type": "object", "properties": {f"field_{i:04d}": {"type": "integer"}
                                                 for i in range(1_900)}}
REQUIRED_95K["required"] = list(REQUIRED_95K["properties"])
OPTIONAL_95K = {"type": "object", "properties": {f"field_{i:04d}": {"type": "integer"}
                                                 for i in range(2_600)}}
PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}}

# (name, route, body, expected status, param of a 400)
HOSTILE = [
    ("20,000 properties", "/v1/chat/completions", _schema_body(OPTIONAL_20K), 400,
     "response_format.json_schema.schema"),
    ("95 KB, optional", "/v1/chat/completions", _schema_body(OPTIONAL_95K), 400,
     "response_format.json_schema.schema"),
    ("95 KB, required", "/v1/chat/completions", _schema_body(REQUIRED_95K), 200, None),
    ("pattern a{1000000}", "/v1/chat/completions", _schema_body(PATTERN), 400,
     "response_format.json_schema.schema"),
    ("regex a{1000000}", "/v1/completions", _completion_body({"regex": "^a{1000000}$"}), 400,
     "structured_outputs.regex"),
    ("choice of 5,000", "/v1/completions",
     _completion_body({"choice": [f"option {i}" for i in range(5_000)]}), 200, None),
    ("choice of 100,000", "/v1/completions",
     _completion_body({"choice": [f"option {i}" for i in range(100_000)]}), 400,
     "structured_outputs.choice"),
]


@pytest.mark.parametrize(("name", "route", "body", "status", "param"), HOSTILE,
                         ids=[case[0] for case in HOSTILE])
def test_hostile_grammars_never_stall_the_server(fault_server, name, route, body, status,
                                                 param):
    raw = json.dumps(body).encode()  # here, not inside the probe's window: this process's own
    assert len(raw) < 4 * 1024 * 1024  # GIL would hold the probe up
    lag_before = loop_lags(fault_server.base_url)
    with health_probe(fault_server.base_url) as latencies:
        started = time.monotonic()
        response = httpx.post(f"{fault_server.base_url}{route}", content=raw, timeout=60,
                              headers={"Content-Type": "application/json"})
        seconds = time.monotonic() - started
    lag = {bound: count - lag_before[bound]
           for bound, count in loop_lags(fault_server.base_url).items()}
    print(f"{name}: {response.status_code} in {seconds:.3f} s; /health max "
          f"{max(latencies):.3f} s over {len(latencies)} probes; loop lags {lag}")
    assert max(latencies) <= HEALTH_BOUND_S, (name, sorted(latencies)[-5:])
    assert lag[float("inf")] - lag[LOOP_LAG_BOUND_S] == 0, (name, lag)
    if status == 400:
        error = assert_error(response, 400, param)
        assert seconds < 1.0, (name, seconds, error)
        return
    assert response.status_code == 200, response.text
    if "choice" in name:  # the answer is one of the options, nothing else
        assert response.json()["choices"][0]["text"] in body["structured_outputs"]["choice"]
    else:
        content = response.json()["choices"][0]["message"]["content"]
        assert content.startswith('{"field_0000":')


def test_the_probe_sees_a_stalled_server(fault_server):
    """Negative control: the same probe, with the server stopped for 1.5 s, sees it."""
    pid = fault_server.process.pid
    lag_before = loop_lags(fault_server.base_url)
    with health_probe(fault_server.base_url) as latencies:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert max(latencies) > HEALTH_BOUND_S
    lag_after = loop_lags(fault_server.base_url)  # the loop's own monitor saw it too
    assert lag_after[float("inf")] - lag_after[1.0] > lag_before[float("inf")] - lag_before[1.0]


def test_a_grammar_that_fails_mid_generation_is_an_error_not_text(fault_server):
    """A grammar that fails after two tokens (the fault `grammar_error`; a real one past the
    engine's limits this late is caught by the admission probe): the request ends with a 500
    (streamed: an error event and no [DONE]), its KV freed, and the server serves on."""
    from engine.faults import marker

    body = {"model": "tiny", "prompt": f"{marker('grammar_error')} Letters:", "max_tokens": 60,
            "structured_outputs": {"regex": "[a-z]{30}"}}
    response = httpx.post(f"{fault_server.base_url}/v1/completions", json=body, timeout=60)
    error = assert_error(response, 500, code="request_failed")
    assert "grammar" in error["message"]
    with httpx.stream("POST", f"{fault_server.base_url}/v1/completions",
                      json={**body, "stream": True}, timeout=60) as streamed:
        events = sse_events(streamed.iter_lines())
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "request_failed"
    assert len(events) >= 2  # it failed mid-generation, after some text
    fault_server.wait_until_idle(timeout=30)
    # Negative control: the same request without the marker is served, and matches.
    fine = httpx.post(f"{fault_server.base_url}/v1/completions", timeout=60,
                      json={**body, "prompt": "Letters:"})
    assert fine.status_code == 200, fine.text
    assert re.fullmatch("[a-z]{30}", fine.json()["choices"][0]["text"])


def test_a_failed_grammar_is_cached_as_failed(fault_server):
    """The same hostile schema sent again is refused from the cache: faster than compiling."""
    schema = {"type": "object", "properties": {"k": {"type": "string",
                                                     "pattern": "^(b{1000}){1000}$"}}}
    times = []
    for _ in range(2):
        started = time.monotonic()
        response = httpx.post(f"{fault_server.base_url}/v1/chat/completions",
                              json=_schema_body(schema), timeout=60)
        times.append(time.monotonic() - started)
        assert_error(response, 400, "response_format.json_schema.schema")
    assert times[1] < times[0], times
