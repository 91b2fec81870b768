"""A client that reads slower than the engine writes (issue 70, part 4): it stalls neither the
other streams nor the engine, and what piled up for it is sent merged, with the same text, token
ids and logprobs as a client that read every event (greedy chat, streamed or not)."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from tests.server.conftest import sse_events
from tests.servers import running_server, wait_until

# 8 choices of 1200 tokens with 20 top logprobs each, ~14 MB of events: the first ~4 MB fit in
# the kernel's socket buffers (loopback autotunes the server's send buffer up to
# net.ipv4.tcp_wmem's 4 MB), the rest backs up in the server.
STALLED_CHOICES = 8
STALLED_TOKENS = 1200
TOP_LOGPROBS = 20
OTHER_TOKENS = 48
NUM_OTHERS = 4


@pytest.fixture(scope="module")
def server(long_context_tiny_model):
    args = ["--model", str(long_context_tiny_model), "--served-model-name", "tiny",
            "--speculative-method", "none", "--max-num-seqs", "16",
            "--stream-stall-timeout", "300"]
    with running_server(args, "tiny") as running:
        yield running


def _chat_body(max_tokens: int, stream: bool, prompt: str, n: int = 1) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
            "logprobs": True, "top_logprobs": TOP_LOGPROBS, "n": n}


def _dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body (after the headers) as its bytes."""
    body, rest = b"", raw
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


def _stream_of(events: list[str]) -> dict[int, tuple[str, list, int, str | None]]:
    """By choice index: (content, [(token, logprob, top)], events carrying content, finish
    reason)."""
    choices: dict[int, list] = {}
    for data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            state = choices.setdefault(choice["index"], ["", [], 0, None])
            delta_text = choice["delta"].get("content") or ""
            state[0] += delta_text
            state[2] += bool(delta_text)
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                state[1].append((entry["token"], entry["logprob"], entry["top_logprobs"]))
            state[3] = choice.get("finish_reason") or state[3]
    return {index: tuple(state) for index, state in choices.items()}


def _whole_of(response: dict) -> dict[int, tuple[str, list, str]]:
    return {choice["index"]: (choice["message"]["content"],
                              [(e["token"], e["logprob"], e["top_logprobs"])
                               for e in choice["logprobs"]["content"]],
                              choice["finish_reason"])
            for choice in response["choices"]}


class StalledClient:
    """A raw socket that sends a streamed chat request and reads nothing until `drain()`: its
    receive buffer is kept small, so the server's writes back up."""

    def __init__(self, base_url: str, body: dict):
        host, port = base_url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        payload = json.dumps(body).encode()
        self.sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            .encode() + payload)

    def drain(self) -> list[str]:
        """Reads the whole response; its SSE `data:` payloads."""
        raw = b""
        self.sock.settimeout(120)
        while chunk := self.sock.recv(1 << 16):
            raw += chunk
        self.sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return sse_events(_dechunk(body).decode().splitlines())


def test_a_stalled_reader_stalls_no_other_stream_and_gets_everything_merged(server):
    prompt = "A reader that stops reading"
    stalled = StalledClient(server.base_url,
                            _chat_body(STALLED_TOKENS, True, prompt, STALLED_CHOICES))
    wait_until(lambda: server.metrics()["num_requests_running"] >= 1, 60, "the stalled request")

    others: list[tuple] = []

    def other(i: int) -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120,
                          json=_chat_body(OTHER_TOKENS, True, f"Other reader {i}")) as r:
            others.append(_stream_of(sse_events(r.iter_lines()))[0])

    threads = [threading.Thread(target=other, args=(i,)) for i in range(NUM_OTHERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    # Every other stream ended while the stalled client had read nothing ...
    assert len(others) == NUM_OTHERS
    assert all(reason == "length" and len(lp) == OTHER_TOKENS for _, lp, _, reason in others)
    # ... and the engine generated all of the stalled request's tokens: it never waits on a
    # reader (its outputs wait, unbounded, for the client).
    wait_until(lambda: server.metrics()["num_requests_running"] == 0, 120,
               "the engine to finish the stalled request")

    streamed = _stream_of(stalled.drain())
    whole = _whole_of(httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json=
                                 _chat_body(STALLED_TOKENS, False, prompt, STALLED_CHOICES)).json())
    assert {i: (c, lp, reason) for i, (c, lp, _, reason) in streamed.items()} == whole
    assert len(whole) == STALLED_CHOICES
    assert all(len(lp) == STALLED_TOKENS for _, lp, _ in whole.values())
    # What piled up went out merged: far fewer events than tokens (negative control: a prompt
    # reader below gets about one a token).
    carrying = sum(state[2] for state in streamed.values())
    assert carrying < STALLED_CHOICES * STALLED_TOKENS * 3 // 4


def test_a_prompt_reader_gets_the_same_answer_streamed_and_whole(server):
    """Greedy chat, streamed to a client that reads every event, equals the whole answer."""
    body = _chat_body(64, True, "A reader that reads")
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      timeout=120) as response:
        content, logprobs, carrying, reason = _stream_of(sse_events(response.iter_lines()))[0]
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                       json={**body, "stream": False}).json()
    assert {0: (content, logprobs, reason)} == _whole_of(whole)
    assert carrying > 32  # events as the engine stepped, not one merged answer
