"""A real server is ready only once every step shape is (server/warm_up.py, engine/metrics/
first_use.py): its first-use counters are exported at 0 and stay there under traffic of every
batch size. The server runs the GPU's padded step layout on the CPU here ($SPECSERVE_PADDED_STEPS).
Negative control: a server whose warm-up leaves batch 2 out counts that shape when two requests
share a step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.metrics.first_use import DOCS, STEP_SHAPE
from engine.runner.padded_settings import PADDED_STEPS_ENV, SKIP_WARM_ENV
from tests.servers import running_server

COUNTERS = [f"{kind}_total" for kind in DOCS]


def _args(folder) -> list[str]:
    return ["--model", str(folder), "--served-model-name", "tiny", "--max-num-seqs", "4",
            "--max-model-len", "256", "--speculative-method", "none"]


def _chat(url: str, words: int, max_tokens: int) -> None:
    body = {"model": "tiny", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": " ".join(["word"] * words)}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            pass


def _concurrently(url: str, num_requests: int, max_tokens: int = 24) -> None:
    with ThreadPoolExecutor(num_requests) as pool:
        list(pool.map(lambda i: _chat(url, 3 + 20 * i, max_tokens), range(num_requests)))


def test_traffic_after_ready_meets_no_shape_for_the_first_time(tiny_chat_model_folder):
    with running_server(_args(tiny_chat_model_folder), "tiny",
                        env={PADDED_STEPS_ENV: "1"}) as server:
        assert httpx.get(f"{server.base_url}/ready", timeout=10).status_code == 200
        metrics = server.metrics()
        assert [metrics[name] for name in COUNTERS] == [0, 0, 0]
        for num_requests in (1, 4, 3, 2):
            _concurrently(server.base_url, num_requests)
        metrics = server.wait_until_idle()
        assert [metrics[name] for name in COUNTERS] == [0, 0, 0]


def test_a_shape_left_out_of_the_warm_up_is_counted(tiny_chat_model_folder):
    with running_server(_args(tiny_chat_model_folder), "tiny",
                        env={PADDED_STEPS_ENV: "1", SKIP_WARM_ENV: "2"}) as server:
        _concurrently(server.base_url, 1)
        assert server.metrics()[f"{STEP_SHAPE}_total"] == 0  # batch 1 was warmed
        _concurrently(server.base_url, 2, max_tokens=64)
        assert server.wait_until_idle()[f"{STEP_SHAPE}_total"] >= 1


def test_a_gpu_warm_up_prefills_every_bucket_up_to_a_chunk():
    from server.warm_up import prefill_lengths, synthetic_prompt

    assert prefill_lengths(2048, 8188) == [1, 4, 16, 64, 256, 1024, 2048]
    assert prefill_lengths(2048, 100) == [1, 4, 16, 64, 100]  # never past the context
    assert prefill_lengths(1, 100) == [1]
    prompts = [synthetic_prompt(n, seed, 50, [3, 7, 49]) for seed, n in enumerate((5, 5), 1)]
    assert [len(p) for p in prompts] == [5, 5] and prompts[0] != prompts[1]  # no cache hit
    assert max(max(p) for p in prompts) < 50
