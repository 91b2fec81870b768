"""A client leaving at any moment (issue 29): before its body is complete, while its prompt is
prefilled, in the middle of a stream, while it waits for a whole response. Against one real
server, for both routes, streamed and not, one choice and two. Each time the server logs no
traceback, counts no 5xx, counts what reached the engine as aborted, and ends with no request
running or waiting and every KV block free.

Where a client left is checked from the engine's own records of the aborted requests, not from
timing alone: `time_to_first_token_seconds` is observed only for a request that got a token, so
an abort during prefill adds an abort and no TTFT, an abort while decoding adds both."""

from __future__ import annotations

import json
import re
import socket
import struct
import uuid

import httpx
import pytest

from tests.servers import running_server, wait_until

# Prompt tokens per engine step. A prompt of LONG_PROMPT_WORDS tokens then takes ~190 steps to
# prefill: a window long enough to leave inside it, even with a tiny model.
PREFILL_CHUNK = 16
LONG_PROMPT_WORDS = 3000
# Far more than a test lets run: a request that is not aborted is still running at the end.
MAX_TOKENS = 4000
ROUTES = ("/v1/completions", "/v1/chat/completions")
LOG_ALARMS = ("Traceback", "ERROR", "Exception")


@pytest.fixture(scope="module")
def server(tmp_path_factory, long_context_tiny_model):
    log_path = tmp_path_factory.mktemp("disconnects") / "server.log"
    with open(log_path, "w") as log, running_server(
            ["--model", str(long_context_tiny_model), "--served-model-name", "tiny",
             "--speculative-method", "none", "--max-num-batched-tokens", str(PREFILL_CHUNK),
             "--log-level", "info"], "tiny", log_file=log) as running:
        running.log_path = log_path
        yield running
        # Each test checks the lines logged while it ran; this also catches what came later.
        assert_log_is_quiet(log_path.read_text())


def _body(path: str, prompt: str, stream: bool, n: int) -> bytes:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
            "n": n}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return json.dumps(body).encode()


def _head(path: str, content_length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


def _connect(server, reset: bool = True) -> socket.socket:
    """`reset`: closing resets the connection (RST), as a killed client or a dropped network
    does, instead of a polite FIN."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sock


class Counts:
    """What the checks compare before and after a client leaves: from /metrics (or its text)
    and the length of the log so far."""

    def __init__(self, server, metrics_text: str | None = None):
        if metrics_text is None:
            metrics_text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        # Every series, labels included, by its full name.
        series = {name: float(value) for name, value in (
            line.rsplit(" ", 1) for line in metrics_text.splitlines() if line and line[0] != "#")}

        def total(prefix: str, label: str = "") -> float:
            return sum(value for name, value in series.items()
                       if name.startswith(f"specserve:{prefix}") and label in name)

        self.aborts = total("request_success_total", 'finished_reason="abort"')
        self.first_tokens = total("time_to_first_token_seconds_count")
        self.five_hundreds = total("http_requests_total", 'status="5')
        self.left_before_answer = total("http_requests_total", 'status="499"')
        self.generated = total("generation_tokens_total")
        self.prompts_started = total("prompt_tokens_total")
        self.log_length = len(server.log_path.read_text())


def _answered(counts: Counts) -> float:
    return counts.left_before_answer + counts.five_hundreds


def _assert_clean_after(server, before: Counts, aborts: int, first_tokens: int,
                        left_before_answer: int) -> None:
    """The server is idle (every KV block free), and the request that left added `aborts`
    aborted engine requests, `first_tokens` of them past prefill, no 5xx and no alarm in the
    log."""
    server.wait_until_idle(timeout=30)
    after = Counts(server)
    assert after.five_hundreds == before.five_hundreds, "a 5xx"
    assert after.aborts - before.aborts == aborts, "aborted engine requests"
    assert after.first_tokens - before.first_tokens == first_tokens, "requests past prefill"
    assert after.left_before_answer - before.left_before_answer == left_before_answer, "499s"
    assert_log_is_quiet(server.log_path.read_text()[before.log_length:])


def assert_log_is_quiet(log: str) -> None:
    alarms = [line for line in log.splitlines() if any(word in line for word in LOG_ALARMS)]
    assert not alarms, log[-4000:]


def _read_token_events(sock: socket.socket, path: str, n: int, per_choice: int) -> None:
    """Reads the stream until each of the n choices has sent `per_choice` token events."""
    key = "text" if path == "/v1/completions" else "content"
    received, counts = b"", dict.fromkeys(range(n), 0)
    while min(counts.values()) < per_choice:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {received[-2000:]!r}"
        received += chunk
        counts = dict.fromkeys(range(n), 0)
        for payload in re.findall(rb"data: (\{.*?\})\n\n", received):
            for choice in json.loads(payload)["choices"]:
                fields = choice if key == "text" else choice["delta"]
                if fields.get(key):
                    counts[choice["index"]] += 1


def _wait_until_every_choice_decodes(server, n: int) -> None:
    """All n choices are in the engine and the batch has taken two more steps with them all:
    each has its first token (its TTFT is checked afterwards)."""
    wait_until(lambda: server.metrics()["num_requests_running"] == n, 30, f"{n} running")
    generated = Counts(server).generated
    wait_until(lambda: Counts(server).generated >= generated + 2 * n, 30, "two more steps")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("sent", ["headers", "half the body"])
def test_leaving_before_the_body_is_complete(server, path, sent):
    body = _body(path, "Hello", stream=False, n=1)
    before = Counts(server)
    # Closed politely (FIN): a reset could discard what the server has not read yet, and then
    # no request would have started at all.
    with _connect(server, reset=False) as sock:
        sock.sendall(_head(path, len(body)) + (b"" if sent == "headers" else body[:50]))
    # Nothing reached the engine, so nothing is aborted; the route answers 499 to nobody.
    wait_until(lambda: _answered(Counts(server)) > _answered(before), 10, "an answer")
    _assert_clean_after(server, before, aborts=0, first_tokens=0, left_before_answer=1)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("n", [1, 2])
def test_leaving_during_prefill(server, path, stream, n):
    # A prompt of its own: one already in the prefix cache would be prefilled in a step.
    body = _body(path, f"{uuid.uuid4()} " + "hello " * LONG_PROMPT_WORDS, stream, n)
    before = Counts(server)
    with _connect(server) as sock:
        sock.sendall(_head(path, len(body)) + body)
        # Scheduled, and no prompt has reached its first token yet.
        wait_until(lambda: server.metrics()["num_requests_running"] >= 1, 30, "prefill",
                   every=0.01)
        assert Counts(server).prompts_started == before.prompts_started, "prefill too fast"
    # With prefix caching a prompt's other choices wait for its first token (FanOut), so only
    # the first of the n choices was in the engine.
    _assert_clean_after(server, before, aborts=1, first_tokens=0,
                        left_before_answer=0 if stream else 1)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("n", [1, 2])
def test_leaving_mid_stream(server, path, n):
    body = _body(path, "Hello", stream=True, n=n)
    before = Counts(server)
    with _connect(server) as sock:
        sock.sendall(_head(path, len(body)) + body)
        _read_token_events(sock, path, n, per_choice=3)
    _assert_clean_after(server, before, aborts=n, first_tokens=n, left_before_answer=0)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("n", [1, 2])
def test_leaving_while_waiting_for_a_whole_response(server, path, n):
    body = _body(path, "Hello", stream=False, n=n)
    before = Counts(server)
    with _connect(server) as sock:
        sock.sendall(_head(path, len(body)) + body)
        _wait_until_every_choice_decodes(server, n)
    _assert_clean_after(server, before, aborts=n, first_tokens=n, left_before_answer=1)


def test_the_checks_can_fail(server):
    """Negative controls: the log check sees a traceback, the 5xx count sees a 500, the idle
    check sees a request that runs on, and the counts see a request that ended on its own."""
    with pytest.raises(AssertionError):
        assert_log_is_quiet("INFO fine\nTraceback (most recent call last):\n  ...\n")
    assert Counts(server, 'specserve:http_requests_total{route="/v1/completions",'
                          'status="500"} 1.0\n').five_hundreds == 1
    before = Counts(server)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      content=_body("/v1/completions", "Hello", stream=True, n=1),
                      headers={"Content-Type": "application/json"}) as response:
        lines = response.iter_lines()  # kept: dropping it closes the connection
        next(lines)
        with pytest.raises(AssertionError, match="server still busy"):
            server.wait_until_idle(timeout=0.5)
    _assert_clean_after(server, before, aborts=1, first_tokens=1, left_before_answer=0)
    before = Counts(server)
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200
    with pytest.raises(AssertionError):
        _assert_clean_after(server, before, aborts=1, first_tokens=1, left_before_answer=0)
    _assert_clean_after(server, before, aborts=0, first_tokens=1, left_before_answer=0)
