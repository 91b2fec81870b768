"""Suffix decoding through the server: a tenant's earlier outputs become its own drafts, never
another tenant's (by cache_salt and by API key); the cache's gauges and per-method acceptance in
/metrics and usage; a bad cache_salt is a 400."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import assert_error
from tests.servers import DEFAULT_MODEL, running_server

PROMPT = "Write a short poem about the autumn wind and falling leaves."


@pytest.fixture(scope="module")
def suffix_server():
    with running_server(["--speculative-method", "suffix"], DEFAULT_MODEL) as running:
        yield running


def _complete(server, headers=None, **fields) -> dict:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, **fields}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers,
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _accepted(body: dict) -> int:
    return body["usage"]["speculative"]["by_method"].get("suffix", {}).get("accepted_tokens", 0)


def test_a_tenants_outputs_draft_for_itself_only(suffix_server):
    first = _complete(suffix_server, cache_salt="alice")
    again = _complete(suffix_server, cache_salt="alice")
    other_salt = _complete(suffix_server, cache_salt="bob")
    other_key = _complete(suffix_server, headers={"Authorization": "Bearer key-of-carol"},
                          cache_salt="alice")
    texts = {b["choices"][0]["text"] for b in (first, again, other_salt, other_key)}
    assert len(texts) == 1  # greedy: lossless whatever was drafted
    # the negative control: the same tenant drafts the whole answer from its earlier output
    assert _accepted(again) >= 30
    # other tenants draft only from their own context
    assert _accepted(other_salt) <= _accepted(first) + 5
    assert _accepted(other_key) <= _accepted(first) + 5
    metrics = suffix_server.metrics()
    assert metrics["suffix_cache_requests"] >= 4
    assert metrics["suffix_cache_partitions"] >= 3
    assert metrics["suffix_cache_bytes"] > 0 and "suffix_cache_evictions_total" in metrics
    assert metrics["spec_decode_num_accepted_tokens_by_method_total"] >= _accepted(again)


@pytest.mark.parametrize("salt", ["", 5, "x" * 257])
def test_a_bad_cache_salt_is_a_400(suffix_server, salt):
    response = httpx.post(f"{suffix_server.base_url}/v1/completions", timeout=30,
                          json={"model": suffix_server.model, "prompt": "hi", "cache_salt": salt})
    assert_error(response, 400, param="cache_salt")
