"""A real Prometheus scrapes the real server; every PromQL expression of every dashboard then
returns data. Skipped, with the reason, where Debian's `prometheus` is not installed."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.deploy.dashboards import dashboard_expressions
from tests.servers import DEFAULT_MODEL, prometheus_query, running_prometheus

SCRAPE_INTERVAL_S = 1

COPY_PROMPT = ("Repeat this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, "
               "theta. Again: alpha, beta, gamma, delta, epsilon, zeta, eta, theta. Again:")


@pytest.fixture
def prometheus(server, tmp_path):
    target = server.base_url.removeprefix("http://")
    config = (f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
              f"scrape_configs:\n  - job_name: specserve\n    static_configs:\n"
              f"      - targets: ['{target}']\n")
    with running_prometheus(config, tmp_path,
                            "dashboards not evaluated against a real one") as url:
        yield url


def _send_traffic(server) -> None:
    base = f"{server.base_url}/v1"
    for max_tokens in (40, 24):  # copy-heavy: n-gram drafts get accepted
        httpx.post(f"{base}/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "prompt": COPY_PROMPT, "max_tokens": max_tokens,
            "temperature": 0}).raise_for_status()
    with httpx.stream("POST", f"{base}/chat/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hello."}]}) as response:
        for _ in response.iter_lines():
            pass
    httpx.post(f"{base}/completions", timeout=120, json={
        "model": DEFAULT_MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0,
        "stop": [","]}).raise_for_status()


def test_every_dashboard_expression_returns_data(server, prometheus):
    # Traffic twice, a few scrapes apart, so every rate() sees the counters move.
    _send_traffic(server)
    time.sleep(3 * SCRAPE_INTERVAL_S)
    _send_traffic(server)
    time.sleep(3 * SCRAPE_INTERVAL_S)
    up = prometheus_query(prometheus, 'up{job="specserve"}')
    assert up and up[0]["value"][1] == "1", up
    expressions = dashboard_expressions(DEFAULT_MODEL)
    assert len(expressions) >= 20
    empty = [expr for expr in expressions if not prometheus_query(prometheus, expr)]
    assert not empty, f"{len(empty)} of {len(expressions)} expressions returned no data: {empty}"
