"""Serving metrics from synthetic timelines (the definitions of `vllm bench serve`, checked by
hand), and the arrival process that paces requests."""

from __future__ import annotations

import statistics

import pytest

from specserve.bench.load import arrival_gaps
from specserve.bench.serving_metrics import RequestRecord, distribution_ms, percentile, summarize


def record(start, chunk_times, end, output_tokens, prompt_tokens=10, error=None, kind="code"):
    return RequestRecord(prompt_id="p", kind=kind, start=start, end=end,
                         chunk_times=list(chunk_times), output_tokens=output_tokens,
                         prompt_tokens=prompt_tokens, error=error)


def test_ttft_tpot_itl_and_latency_of_one_request():
    # Sent at 10.0 s; text chunks at 10.5, 10.6, 10.9 (the last carries 3 tokens: a speculative
    # step); done at 11.0 s with 5 output tokens.
    r = record(10.0, [10.5, 10.6, 10.9], 11.0, output_tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.0)
    # TPOT = (latency - TTFT) / (output tokens - 1) = 0.5 / 4, not per chunk
    assert r.tpot == pytest.approx(0.125)
    assert r.itls == pytest.approx([0.1, 0.3])


def test_no_tpot_for_one_token_and_no_ttft_without_text():
    assert record(0.0, [0.2], 0.3, output_tokens=1).tpot is None
    silent = record(0.0, [], 0.3, output_tokens=0)
    assert silent.ttft is None and silent.tpot is None and silent.itls == []


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_is_in_milliseconds():
    summary = distribution_ms([0.010, 0.020, 0.030])
    assert summary["mean"] == pytest.approx(20.0)
    assert summary["p50"] == pytest.approx(20.0)
    assert summary["p99"] == pytest.approx(29.8)
    assert summary["std"] == pytest.approx(8.165, abs=1e-3)
    assert distribution_ms([]) == {"mean": None, "std": None, "p50": None, "p90": None,
                                   "p99": None}


def test_summary_counts_throughputs_and_ignores_failed_requests():
    records = [
        record(0.0, [0.5, 1.0], 1.5, output_tokens=3, prompt_tokens=20),  # TPOT 0.5
        record(0.0, [1.0, 1.5, 2.0], 4.0, output_tokens=7, prompt_tokens=30),  # TPOT 0.5
        record(0.0, [], 0.1, output_tokens=0, prompt_tokens=None, error="HTTP 400: bad"),
    ]
    summary = summarize(records, duration=5.0)
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert summary["errors"] == ["HTTP 400: bad"]
    assert summary["total_output_tokens"] == 10 and summary["total_input_tokens"] == 50
    assert summary["request_throughput"] == pytest.approx(0.4)
    assert summary["output_throughput"] == pytest.approx(2.0)
    assert summary["total_token_throughput"] == pytest.approx(12.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(500.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(500.0)  # gaps 0.5, 0.5, 0.5
    assert summary["e2el_ms"]["p50"] == pytest.approx(2750.0)
    with pytest.raises(ValueError):
        summarize(records, duration=0.0)


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    gaps = arrival_gaps(20_001, request_rate=4.0, seed=7)
    assert gaps[0] == 0.0 and all(gap > 0 for gap in gaps[1:])
    assert sum(gaps[1:]) / 20_000 == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps[1:]) == pytest.approx(0.25, rel=0.05)
    assert arrival_gaps(5, 4.0, seed=7) == gaps[:5]
    assert arrival_gaps(3, float("inf"), seed=7) == [0.0, 0.0, 0.0]
