"""GET /metrics: Prometheus text with the engine's counters and the server's gauges."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.config import SpeculativeConfig


def test_metrics_count_a_request(server):
    server.wait_until_idle()
    before = server.metrics()
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"prompt": "One, two, three, four,", "max_tokens": 6,
                                "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    speculative = response.json()["usage"]["speculative"]
    after = server.metrics()
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 6
    assert after["request_success_total"] - before["request_success_total"] == 1
    # The engine's counters agree with the response's usage extension.
    for usage_name, series in [("draft_tokens", "spec_decode_num_draft_tokens_total"),
                               ("accepted_tokens", "spec_decode_num_accepted_tokens_total"),
                               ("num_drafts", "spec_decode_num_drafts_total")]:
        assert after[series] - before[series] == speculative[usage_name]
    assert after["kv_cache_num_blocks"] > 0 and after["num_requests_running"] == 0


def test_metrics_are_valid_prometheus_text(server):
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {"specserve:num_requests_running", "specserve:num_requests_queued",
            "specserve:time_to_first_token_seconds"} <= names


def test_per_position_acceptance_series_for_every_draft_position(server):
    families = text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
    positions = {sample.labels["position"] for family in families for sample in family.samples
                 if sample.name == "specserve:spec_decode_num_accepted_tokens_per_pos_total"}
    k = SpeculativeConfig().num_speculative_tokens  # the server runs the default
    assert positions == {str(i) for i in range(k)}


def test_metrics_prefix_vllm(guarded_server):
    text = httpx.get(f"{guarded_server.base_url}/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny"}' in text
    assert "specserve:" not in text


def test_http_requests_are_counted_by_route_template_and_status(server):
    def count(route, status):
        families = text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
        return sum(sample.value for family in families for sample in family.samples
                   if sample.name == "specserve:http_requests_total"
                   and sample.labels == {"route": route, "status": status})

    before = count("/v1/models/{model_id:path}", "404"), count("/v1/completions", "400")
    httpx.get(f"{server.base_url}/v1/models/not-this-one")
    httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "n": 0})
    after = count("/v1/models/{model_id:path}", "404"), count("/v1/completions", "400")
    assert after == (before[0] + 1, before[1] + 1)
