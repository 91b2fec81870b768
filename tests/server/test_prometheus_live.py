"""A real Prometheus scrapes the real server; every PromQL expression of every dashboard then
returns data. Skipped, with the reason, where Debian's `prometheus` is not installed."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.dashboards import dashboard_expressions
from tests.servers import DEFAULT_MODEL, prometheus_query, running_prometheus, wait_until

SCRAPE_INTERVAL_S = 1
SCRAPE_WAIT_S = 60  # a deadline for a scrape to happen, not a time the test expects to take
GENERATED = f'specserve:generation_tokens_total{{model_name="{DEFAULT_MODEL}"}}'

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


def _scraped_generation_tokens(prometheus: str) -> float:
    """The newest generation-token count Prometheus holds for the server (0 while no scrape has
    seen the series: the server makes it at its first request)."""
    series = prometheus_query(prometheus, f"sum({GENERATED})")
    return float(series[0]["value"][1]) if series else 0.0


def _wait_for_scrape_of(server, prometheus: str) -> None:
    """Waits until a scrape has seen the server's counters at least where they stand now (the
    traffic sent so far has ended, so they stand still)."""
    now = server.metrics().get("generation_tokens_total", 0.0)
    wait_until(lambda: _scraped_generation_tokens(prometheus) >= now, SCRAPE_WAIT_S,
               f"a scrape to see generation_tokens_total at {now}", every=0.2)


def test_every_dashboard_expression_returns_data(server, prometheus):
    """Every rate() needs two samples of a counter in its window with different values. So the
    traffic comes in two bursts, each sent only after a scrape has seen what came before it (the
    first before any traffic of this test, the second after the first burst). Waiting on those
    scrapes, not on a fixed sleep, makes the test hold on a machine of any speed: on a fast one
    both bursts once ended before the first scrape, and every counter looked flat."""
    wait_until(lambda: prometheus_query(prometheus, 'up{job="specserve"} == 1'), SCRAPE_WAIT_S,
               "Prometheus' first scrape of the server", every=0.2)
    _wait_for_scrape_of(server, prometheus)
    _send_traffic(server)
    _wait_for_scrape_of(server, prometheus)
    _send_traffic(server)
    _wait_for_scrape_of(server, prometheus)

    expressions = dashboard_expressions(DEFAULT_MODEL)
    assert len(expressions) >= 20
    empty = [expr for expr in expressions if not prometheus_query(prometheus, expr)]
    assert not empty, f"{len(empty)} of {len(expressions)} expressions returned no data: {empty}"


def test_traffic_before_the_first_scrape_leaves_the_rate_ratios_empty(server, request):
    """Negative control for the waits above: what a fast machine did to the old fixed sleeps.
    All the traffic ends before Prometheus starts, so every scrape sees the counters standing
    still, and the dashboard's rate() ratios are empty. So the check above fails when the
    counters do not move between scrapes."""
    _send_traffic(server)
    prometheus = request.getfixturevalue("prometheus")
    wait_until(lambda: prometheus_query(prometheus, f"count_over_time({GENERATED}[1m]) >= 2"),
               SCRAPE_WAIT_S, "two scrapes of the server", every=0.2)
    assert prometheus_query(prometheus, f"sum(rate({GENERATED}[1m]))")  # two samples, rate 0
    empty = [expr for expr in dashboard_expressions(DEFAULT_MODEL)
             if not prometheus_query(prometheus, expr)]
    assert f"sum(rate({GENERATED}[1m]))" not in empty
    assert len(empty) >= 10, empty
