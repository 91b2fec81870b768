"""A request's timestamps turned into spans (engine/metrics/stats.py) and histogram observations
(engine/metrics/prometheus.py), with forged stamps: the spans add up, and a stamp never taken
keeps its spans out of the histograms."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engine.core.request import Request, RequestStatus
from engine.metrics.prometheus import PrometheusMetrics
from engine.metrics.stats import delivery_stats, request_stats
from engine.sampling_params import SamplingParams


def _request(**stamps) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=10.0)
    for name, value in stamps.items():
        setattr(request, name, value)
    return request


SERVED = dict(rendered_time=10.001, tokenized_time=10.0015, queued_time=10.002,
              first_scheduled_time=10.003, first_token_time=10.023, last_token_time=10.083,
              finished_time=10.083, status=RequestStatus.FINISHED_LENGTH)


def test_served_spans_add_up_to_the_time_to_first_token():
    stats = request_stats(_request(**SERVED))
    assert stats.render_seconds == pytest.approx(0.001)
    assert stats.tokenize_seconds == pytest.approx(0.0005)
    assert stats.front_seconds == pytest.approx(0.002)
    assert stats.queue_seconds == pytest.approx(0.001)  # from queued, not from arrival
    assert stats.prefill_seconds == pytest.approx(0.020)
    assert stats.time_to_first_token == pytest.approx(
        stats.front_seconds + stats.queue_seconds + stats.prefill_seconds)
    assert stats.inference_seconds == pytest.approx(0.080)
    written = delivery_stats(_request(**SERVED), first_written=10.0245, last_written=10.0841)
    assert written.first_token_write_delay == pytest.approx(0.0015)
    assert written.last_token_write_delay == pytest.approx(0.0011)
    assert written.time_to_first_token_written == pytest.approx(0.0245)
    assert written.first_token_overhead == pytest.approx(0.0245 - 0.020)


def test_offline_request_has_no_front_and_queues_from_arrival():
    stats = request_stats(_request(first_scheduled_time=10.004, first_token_time=10.02,
                                   finished_time=10.05, status=RequestStatus.FINISHED_STOPPED))
    assert (stats.front_seconds, stats.render_seconds, stats.tokenize_seconds) == (None,) * 3
    assert stats.queue_seconds == pytest.approx(0.004)


def _counts(registry: CollectorRegistry) -> dict[str, float]:
    return {sample.name.removeprefix("specserve:").removesuffix("_count"): sample.value
            for family in registry.collect() for sample in family.samples
            if sample.name.endswith("_count")}


def test_a_request_without_a_first_token_stays_out_of_the_first_token_spans():
    registry = CollectorRegistry()
    metrics = PrometheusMetrics("m", registry)
    aborted = _request(queued_time=10.002, first_scheduled_time=10.003, finished_time=10.01,
                       status=RequestStatus.FINISHED_ABORTED)
    metrics.on_request_finished(request_stats(aborted))
    metrics.on_request_delivered(delivery_stats(aborted, None, None))
    counts = _counts(registry)
    # It counts where it has both stamps (arrival to finish; queued to scheduled) ...
    assert counts["e2e_request_latency_seconds"] == 1
    assert counts["request_queue_time_seconds"] == 1
    assert counts["request_front_time_seconds"] == 1
    # ... and nowhere a first token is needed.
    for name in ("time_to_first_token_seconds", "request_prefill_time_seconds",
                 "request_first_token_write_delay_seconds",
                 "time_to_first_token_written_seconds", "request_first_token_overhead_seconds",
                 "request_last_token_write_delay_seconds"):
        assert counts.get(name, 0) == 0, name


def test_each_request_is_observed_once_per_span():
    registry = CollectorRegistry()
    metrics = PrometheusMetrics("m", registry)
    for _ in range(3):
        request = _request(**SERVED)
        metrics.on_request_finished(request_stats(request))
        metrics.on_request_delivered(delivery_stats(request, 10.025, 10.085))
    counts = _counts(registry)
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_front_time_seconds",
                 "request_template_time_seconds", "request_tokenize_time_seconds",
                 "request_inference_time_seconds", "time_to_first_token_written_seconds",
                 "request_first_token_write_delay_seconds",
                 "request_last_token_write_delay_seconds",
                 "request_first_token_overhead_seconds"):
        assert counts[name] == 3, name
