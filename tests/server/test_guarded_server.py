"""A server with an API key (from SPECSERVE_API_KEY), one batch slot and a queue of one: 401s, the
open health check, and 503 with Retry-After when the queue is full."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, assert_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
    {"Authorization": "Basic " + API_KEY},
])
def test_missing_or_wrong_api_key_is_401(guarded_server, headers):
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/v1/models/tiny")]:
        response = httpx.request(method, f"{guarded_server.base_url}{path}", headers=headers,
                                 json={"prompt": "x"}, timeout=30)
        assert_error(response, 401, code="invalid_api_key")


def test_health_version_and_metrics_stay_open(guarded_server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{guarded_server.base_url}{path}").status_code == 200


def test_the_right_key_is_served(guarded_server):
    client = openai.OpenAI(base_url=f"{guarded_server.base_url}/v1", api_key=API_KEY,
                           max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_server.base_url}/v1", api_key="nope",
                      max_retries=0).models.list()


def test_a_full_queue_answers_503_with_retry_after(guarded_server):
    base = guarded_server.base_url
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 8000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
        # A holds the only batch slot; B is accepted and waits; C finds the queue full.
        with client.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                assert guarded_server.metrics()["num_requests_queued"] == 1
                refused = client.post("/v1/completions", json={**long, "stream": False})
                assert_error(refused, 503, code="queue_full")
                assert refused.headers["Retry-After"] == "1"
    guarded_server.wait_until_idle()
    # Served again once the queue drained.
    response = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
