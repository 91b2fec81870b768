"""Engine stats as Prometheus metrics: counters agree with per-request stats exactly."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.metrics.prometheus import PrometheusMetrics
from engine.metrics.stat_logger import PeriodicStatLogger
from tests.conftest import make_llm

PROMPTS = ["a b c d a b c d a b c d a b", "1 2 3 4 5 1 2 3 4 5 1 2", "Hello there", "x y x y x y"]


def _samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name, **labels):
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == v2 for k, v2 in labels.items()))


@pytest.fixture(scope="module")
def workload(tiny_chat_model_folder):
    llm = make_llm(str(tiny_chat_model_folder), speculative_method="ngram", adaptive=False)
    engine = llm.engine
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(engine.model_name, registry, engine_state=lambda: (
        len(engine.scheduler.running), len(engine.scheduler.waiting), engine.block_manager.usage))
    engine.add_stat_listener(metrics)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outputs += llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0.7))
    return engine.model_name, registry, outputs


def test_counters_equal_the_sum_of_per_request_stats(workload):
    model, registry, outputs = workload
    s = _samples(registry)
    p = "specserve:"
    drafted = sum(o.spec_stats.num_draft_tokens for o in outputs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outputs)
    assert drafted > 0
    assert _value(s, p + "spec_decode_num_draft_tokens_total", model_name=model) == drafted
    assert _value(s, p + "spec_decode_num_accepted_tokens_total") == accepted <= drafted
    assert _value(s, p + "spec_decode_num_drafts_total") == sum(o.spec_stats.num_drafts
                                                                for o in outputs)
    assert _value(s, p + "spec_decode_num_emitted_tokens_total") == sum(
        o.spec_stats.num_emitted_tokens for o in outputs)
    per_position = [_value(s, p + "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(6)]
    assert sum(per_position) == accepted
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert _value(s, p + "generation_tokens_total") == sum(len(o.token_ids) for o in outputs)
    assert _value(s, p + "prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in outputs)
    assert _value(s, p + "request_success_total", finished_reason="length") == len(outputs)
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                      "request_queue_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert _value(s, p + histogram + "_count") == len(outputs), histogram
    steps = _value(s, p + "engine_step_time_seconds_count")
    assert steps > 0 and _value(s, p + "iteration_tokens_total_count") == steps
    assert _value(s, p + "num_requests_running") == 0
    assert _value(s, p + "kv_cache_usage_perc") == 0


def test_metrics_prefix_renames_every_metric(tiny_chat_model_folder):
    registry = CollectorRegistry()
    PrometheusMetrics("m", registry, prefix="vllm")
    names = {name for name, _ in _samples(registry)}
    assert names and all(name.startswith("vllm:") for name in names)


def test_per_position_acceptance_series_exist_before_any_step():
    """vLLM pre-creates spec_decode_num_accepted_tokens_per_pos for positions 0..K-1."""
    registry = CollectorRegistry()
    PrometheusMetrics("m", registry, num_speculative_tokens=4)
    series = {dict(labels)["position"]: value for (name, labels), value in _samples(registry).items()
              if name == "specserve:spec_decode_num_accepted_tokens_per_pos_total"}
    assert series == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0}
    plain = CollectorRegistry()
    PrometheusMetrics("m", plain)  # no speculation, no per-position series
    assert not any(name.endswith("per_pos_total") for name, _ in _samples(plain))


def test_periodic_log_line(caplog):
    from engine.metrics.spec_stats import SpecStats
    from engine.metrics.stats import StepStats

    now = [0.0]
    stat_logger = PeriodicStatLogger(interval_seconds=10, clock=lambda: now[0])
    spec = SpecStats()
    spec.record(4, 2)
    step = StepStats(num_batched_tokens=5, step_seconds=0.1, num_running=3, num_waiting=1,
                     kv_cache_usage=0.25, num_prompt_tokens=100, num_generated_tokens=30,
                     num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, spec=spec,
                     num_speculating=1)
    with caplog.at_level(logging.INFO, logger="specserve.stats"):
        stat_logger.on_step(step)
        assert not caplog.records
        now[0] = 10.0
        stat_logger.on_step(step)
    (record,) = caplog.records
    assert record.getMessage() == (
        "prompt 20.0 tok/s, generation 6.0 tok/s, running 3, waiting 1, KV cache 25.0%, "
        "drafts accepted 50.0%, mean acceptance length 3.00")
