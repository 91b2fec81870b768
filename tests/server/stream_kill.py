"""A process killed under a stream in flight (the engine core's own process, a tensor-parallel
rank): the stream must end within 10 s with an `engine_dead` error and no [DONE]."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.servers import wait_until


def kill_under_a_stream(server, prompt: str, max_tokens: int, pid: int, first_events: int,
                        what: str) -> float:
    """Streams a greedy completion of `prompt`, SIGKILLs `pid` after `first_events` data lines,
    checks how the stream ended, and returns when the kill was sent (time.monotonic)."""
    events, ended = [], threading.Event()

    def read_stream():
        body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              timeout=60) as response:
                events.extend(response.iter_lines())
        finally:
            ended.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    wait_until(lambda: sum(line.startswith("data: ") for line in events) >= first_events, 60,
               "the stream's first tokens")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert ended.wait(10), f"the stream did not end after {what} died"
    reader.join()
    data = [line for line in events if line.startswith("data: ")]
    error = json.loads(data[-1].removeprefix("data: "))
    assert error["error"]["code"] == "engine_dead", data[-1]
    assert "data: [DONE]" not in data
    return killed_at
