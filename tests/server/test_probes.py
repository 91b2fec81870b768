"""Liveness (`/health`) and readiness (`/ready`) of real server processes: readiness fails while
the admission queue is full and comes back when it empties; a wedged engine loop (a fault
injected through the environment) fails liveness, and readiness with it, while the event loop
still answers. Draining's flip is in test_drain.py."""

from __future__ import annotations

import threading

import httpx

from server.lifecycle import WEDGE_ENV
from tests.server.conftest import API_KEY, assert_error
from tests.servers import running_server, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _probe(base_url: str, path: str) -> tuple[int, dict]:
    response = httpx.get(f"{base_url}{path}", timeout=10)
    return response.status_code, response.json()



def test_readiness_follows_the_admission_queue(guarded_server):
    """guarded_server: one batch slot, --max-queue 1. A running request leaves the server ready;
    a second one waiting fills the queue; when both end, it is ready again."""
    url = guarded_server.base_url
    assert _probe(url, "/ready") == (200, {"status": "ok"})
    stop = threading.Event()
    first_token = [threading.Event(), threading.Event()]

    def stream(index: int) -> None:
        body = {"model": "tiny", "prompt": "Go on.", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                          timeout=60) as response:
            for _ in response.iter_lines():
                first_token[index].set()
                if stop.is_set():
                    return

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        clients[0].start()
        assert first_token[0].wait(30)
        assert _probe(url, "/ready") == (200, {"status": "ok"})  # running is not queued
        clients[1].start()
        wait_until(lambda: _probe(url, "/ready")[0] == 503, 20, "/ready to say 503")
        assert _probe(url, "/ready") == (503, {"status": "queue_full"})
        assert _probe(url, "/health") == (200, {"status": "ok"})  # busy is alive
        refused = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=10,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert_error(refused, 503, code="queue_full")
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
    guarded_server.wait_until_idle(timeout=30)
    assert _probe(url, "/ready") == (200, {"status": "ok"})


def test_a_wedged_engine_loop_fails_liveness(tiny_chat_model_folder):
    args = ["--model", str(tiny_chat_model_folder), "--served-model-name", "tiny",
            "--speculative-method", "none", "--engine-step-timeout", "1"]
    with running_server(args, "tiny", env={WEDGE_ENV: "1"}) as server:
        url = server.base_url
        # Warmed up before the fault armed: live and ready until a step runs.
        assert _probe(url, "/health") == (200, {"status": "ok"})
        assert _probe(url, "/ready") == (200, {"status": "ok"})
        def send() -> None:
            try:
                httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
            except httpx.HTTPError:
                pass  # it never gets an answer: the server is killed below

        request = threading.Thread(target=send, daemon=True)
        request.start()
        wait_until(lambda: _probe(url, "/health")[0] == 503, 20, "/health to say 503")
        assert _probe(url, "/health") == (503, {"status": "engine_stalled"})
        assert _probe(url, "/ready") == (503, {"status": "engine_stalled"})
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        server.process.kill()  # a wedged engine cannot drain; Kubernetes would do the same
        server.process.wait(timeout=30)
