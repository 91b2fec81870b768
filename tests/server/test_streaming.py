"""Streams under load and clients that leave: every stream ends with [DONE], and a client that
disconnects takes its engine requests (and their KV blocks) with it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.server.conftest import sse_events

LONG = {"prompt": "Write a long story about a dragon.", "max_tokens": 4000, "ignore_eos": True,
        "temperature": 1.0, "seed": 3}


def test_client_disconnect_mid_stream_frees_the_engine(server):
    server.wait_until_idle()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={**LONG, "stream": True, "n": 2}) as response:
        chunks = response.iter_lines()
        received = [line for line, _ in zip(chunks, range(6))]
        assert any(line.startswith("data: {") for line in received)
        # The second choice joins once the first has prefilled the shared prompt.
        deadline = time.monotonic() + 10
        while (busy := server.metrics())["num_requests_running"] < 2:
            assert time.monotonic() < deadline, busy
            time.sleep(0.02)
        assert busy["kv_cache_free_blocks"] < busy["kv_cache_num_blocks"]
        # /health answers while the engine is busy generating.
        started = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 2
    # Leaving the block closed the connection mid-stream.
    server.wait_until_idle(timeout=5)


def test_client_disconnect_while_waiting_for_a_whole_response(server):
    before = server.wait_until_idle()
    started = time.monotonic()
    try:
        httpx.post(f"{server.base_url}/v1/chat/completions", timeout=1.5,
                   json={"messages": [{"role": "user", "content": LONG["prompt"]}],
                         **{k: v for k, v in LONG.items() if k != "prompt"}})
        raise AssertionError("4000 tokens should not have finished in 1.5 s")
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    after = server.wait_until_idle(timeout=5)
    # The engine was generating for this client (not refusing it), and it stopped well short of
    # the 4000 tokens asked for, within seconds of the client leaving.
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert 0 < generated < 4000, generated
    assert time.monotonic() - started < 1.5 + 5


def test_32_concurrent_streaming_clients_all_finish(server):
    async def one_stream(client: httpx.AsyncClient, i: int) -> list[str]:
        chat = i % 2 == 0
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"messages": [{"role": "user", "content": f"Count to {i}."}]} if chat \
            else {"prompt": f"Number {i} is"}
        body |= {"max_tokens": 6, "stream": True, "temperature": 0.7, "seed": i,
                 "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            raw = "".join([text async for text in response.aiter_text()])
        assert raw.endswith("data: [DONE]\n\n")
        return sse_events(raw.split("\n\n"))

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(32)))

    for events in asyncio.run(main()):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        *content, usage_chunk = chunks
        assert usage_chunk["choices"] == [] and 1 <= usage_chunk["usage"]["completion_tokens"] <= 6
        assert [c["choices"][0]["finish_reason"] for c in content][-1] in ("stop", "length")
        assert len({c["id"] for c in chunks}) == 1
    server.wait_until_idle()
