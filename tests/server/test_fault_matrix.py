"""The fault matrix (issue 48), each case injected into a real server through the test-only
hook (engine/faults.py: `SPECSERVE_FAULT` arms a fault, a prompt's `[fault:<name>]` marker fires
it), each with its negative control:

- a fault in one request's rows (NaN logits, an exception verifying them, a tokenizer error)
  fails that request alone, with a 500 (streamed: an error event, no [DONE]), its KV freed, while
  a request beside it in the batch finishes; the marker on a server without the fault armed is
  served;
- a fault in no one request's part (an exception in the step, CUDA out of memory) ends every
  request in flight with an error, fails /health, and the process exits 1 within 10 s;
- KV exhaustion by long prompts: preemption and recompute, every request complete, nothing lost;
  a request that could never fit is a 400.

A grammar failing mid-generation is in test_hostile_grammars.py; a stream nobody reads, in
test_hostile_clients.py."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from engine.faults import FAULT_ENV, marker
from tests.server.conftest import API_KEY, FAULT_SERVER_KV_BLOCKS, assert_error, sse_events
from tests.servers import running_server, wait_until

PER_REQUEST = ["nan_logits", "row_error", "detokenize_error"]


def _completion(server, prompt: str, max_tokens: int = 40, stream: bool = False, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, **extra}
    if not stream:
        return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=120) as response:
        return response.status_code, sse_events(response.iter_lines())


@pytest.mark.parametrize("fault", PER_REQUEST)
def test_a_fault_in_one_requests_rows_fails_it_alone(fault_server, fault):
    beside: dict = {}
    # A long request already in the batch when the faulty one arrives, and still after it.
    thread = threading.Thread(target=lambda: beside.update(
        events=_completion(fault_server, "A long story:", max_tokens=300, stream=True)))
    thread.start()
    wait_until(lambda: fault_server.metrics()["num_requests_running"] >= 1, 30,
               "the long request to run")
    failed = _completion(fault_server, f"{marker(fault)} Hello", max_tokens=20)
    error = assert_error(failed, 500, code="request_failed")
    assert fault.split("_")[0] in error["message"].lower() or "injected" in error["message"]
    status, events = _completion(fault_server, f"{marker(fault)} Hello", stream=True)
    assert status == 200 and "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "request_failed"
    thread.join(timeout=120)
    status, events = beside["events"]
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                   if json.loads(e)["choices"])
    assert text  # it ran to its end beside the failures
    assert httpx.get(f"{fault_server.base_url}/health", timeout=10).status_code == 200
    fault_server.wait_until_idle(timeout=30)


def test_the_markers_are_inert_where_no_fault_is_armed(guarded_server):
    """Negative control: the same prompts on a server without SPECSERVE_FAULT are served."""
    for fault in PER_REQUEST + ["step_error", "oom"]:
        response = httpx.post(f"{guarded_server.base_url}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": "tiny", "prompt": f"{marker(fault)} Hello",
                                    "max_tokens": 5})
        assert response.status_code == 200, (fault, response.text)


@pytest.mark.parametrize("fault", ["step_error", "oom"])
def test_an_unattributed_fault_ends_everything_and_exits_non_zero(long_context_tiny_model,
                                                                   fault):
    args = ["--model", str(long_context_tiny_model), "--served-model-name", "tiny",
            "--speculative-method", "none", "--max-num-seqs", "4"]
    with running_server(args, "tiny", env={FAULT_ENV: fault}) as server:
        results: list = []

        def stream() -> None:
            try:
                results.append(_completion(server, "A long story:", max_tokens=3000,
                                           stream=True))
            except httpx.HTTPError as error:  # a connection cut counts as an error too
                results.append(error)

        streams = [threading.Thread(target=stream) for _ in range(3)]
        for thread in streams:
            thread.start()
        wait_until(lambda: server.metrics()["num_requests_running"] >= 3, 30,
                   "three streams to run")
        started = time.monotonic()
        response = _completion(server, f"{marker(fault)} Hello")
        assert_error(response, 503, code="engine_dead")
        for thread in streams:
            thread.join(timeout=10)
            assert not thread.is_alive(), "a request hangs"
        for result in results:  # each ended with an error, never [DONE]
            assert not isinstance(result, tuple) or (
                "[DONE]" not in result[1] and
                json.loads(result[1][-1])["error"]["code"] == "engine_dead"), result
        try:
            health = httpx.get(f"{server.base_url}/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone
        assert health != 200
        returncode = server.process.wait(timeout=max(0.1, 10 - (time.monotonic() - started)))
        print(f"{fault}: exit {returncode} {time.monotonic() - started:.2f} s after the fault")
        assert returncode == 1, returncode


def test_kv_exhaustion_preempts_and_loses_nothing(fault_server):
    """Eight prompts of ~300 tokens, 60 new tokens each: 2,880 tokens of KV wanted at once, 1,024
    held. Every request completes with all its tokens; a request larger than the whole cache is
    a 400 at admission."""
    before = fault_server.metrics().get("num_preemptions_total", 0)
    outcomes: list = []
    # Distinct first words: no prompt shares a cached block with another.
    threads = [threading.Thread(target=lambda i=i: outcomes.append(
        _completion(fault_server, f"story {i}: " + "word " * 300, max_tokens=60)))
        for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a request hangs"
    for response in outcomes:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 60
    # Negative control of the premise: the cache did run out.
    assert fault_server.metrics()["num_preemptions_total"] > before
    fault_server.wait_until_idle(timeout=30)
    capacity = FAULT_SERVER_KV_BLOCKS * 16
    never = _completion(fault_server, "word " * capacity, max_tokens=10)
    assert_error(never, 400)
    assert "KV cache" in never.json()["error"]["message"] or \
        "context length" in never.json()["error"]["message"]


def test_a_failed_request_ends_a_responses_stream_with_an_error_event(fault_server):
    """The Responses API meets a failed request as chat does: a 500 `request_failed` whole, and
    streamed an `error` event and no `response.completed`. The control: the same input without
    the marker finishes."""
    def respond(text: str, stream: bool):
        body = {"model": "tiny", "input": text, "max_output_tokens": 20, "temperature": 0,
                "store": False, "stream": stream}
        url = f"{fault_server.base_url}/v1/responses"
        if not stream:
            return httpx.post(url, json=body, timeout=120)
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            return response.status_code, [json.loads(e) for e in
                                          sse_events(response.iter_lines())]

    assert_error(respond(f"{marker('row_error')} Hello", stream=False), 500,
                 code="request_failed")
    status, events = respond(f"{marker('row_error')} Hello", stream=True)
    types = [e["type"] for e in events]
    assert status == 200 and types[-1] == "error"
    assert not {"response.completed", "response.incomplete"} & set(types)
    assert events[-1]["code"] == "request_failed"
    status, events = respond("Hello", stream=True)
    # (a random tiny model runs to max_output_tokens: "incomplete", a finished response)
    assert status == 200 and events[-1]["type"] == "response.incomplete"
    fault_server.wait_until_idle(timeout=30)
