"""`bench serve`'s server_timeline section: a run's figures from the growth of /metrics histograms
(specserve/bench/server_metrics.py), with forged expositions."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from specserve.bench.server_metrics import (
    bucket_quantile,
    timeline_histograms,
    timeline_summary,
)


def _exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_a_run_reads_only_what_grew_during_it():
    registry = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"],
                     buckets=(0.01, 0.02, 0.04), registry=registry)
    for _ in range(5):  # before the run: not the run's
        ttft.labels("m").observe(0.035)
    before = timeline_histograms(_exposition(registry))
    for value in (0.012, 0.014, 0.016, 0.018):  # the run: all in (0.01, 0.02]
        ttft.labels("m").observe(value)
    summary = timeline_summary(before, timeline_histograms(_exposition(registry)))
    row = summary["time_to_first_token"]
    assert row["count"] == 4
    assert row["mean_ms"] == pytest.approx(15.0)
    # Half the run's 4 observations lie below the middle of (10, 20] ms, linearly.
    assert row["p50_ms"] == pytest.approx(15.0)
    assert set(summary) == {"time_to_first_token"}  # what the server does not export is absent


def test_label_sets_are_summed():
    registry = CollectorRegistry()
    queue = Histogram("specserve:request_queue_time_seconds", "", ["model_name"],
                      buckets=(0.001, 0.01), registry=registry)
    queue.labels("a").observe(0.0005)
    queue.labels("b").observe(0.005)
    summary = timeline_summary(None, timeline_histograms(_exposition(registry)))
    assert summary["request_queue_time"]["count"] == 2


def test_quantiles_from_buckets():
    buckets = {0.001: 2.0, 0.01: 6.0, float("inf"): 8.0}
    assert bucket_quantile(0.25, buckets) == pytest.approx(0.001)  # rank 2 ends the first bucket
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 2 / 4)
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.01)  # +Inf: the last finite bound
    assert bucket_quantile(0.5, {0.01: 0.0, float("inf"): 0.0}) is None


def test_servers_without_the_histograms_get_no_section():
    # llama-server's own exposition: counters and gauges only.
    llama_server = ("# TYPE llamacpp:prompt_tokens_total counter\n"
                    "llamacpp:prompt_tokens_total 12\n")
    assert timeline_summary(timeline_histograms(llama_server),
                            timeline_histograms(llama_server)) is None
    assert timeline_summary(None, None) is None  # no /metrics at all
