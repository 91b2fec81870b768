"""Acceptance figures from the /metrics counters of specserve, vLLM and llama.cpp."""

from __future__ import annotations

import pytest

from specserve.bench.server_metrics import spec_counters, speculation_summary

SPECSERVE = """\
# HELP specserve:spec_decode_num_drafts_total Verify steps that carried drafts
# TYPE specserve:spec_decode_num_drafts_total counter
specserve:spec_decode_num_drafts_total{model_name="m"} 10.0
specserve:spec_decode_num_drafts_created{model_name="m"} 1.7e9
specserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
specserve:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0
specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
specserve:generation_tokens_total{model_name="m"} 500.0
"""

VLLM_TWO_ENGINES = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 16
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 24
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 20
"""

LLAMA_CPP_OLD = """\
# TYPE llamacpp:n_drafted_total counter
llamacpp:n_drafted_total 40
# TYPE llamacpp:n_drafted_accepted_total counter
llamacpp:n_drafted_accepted_total 25
llamacpp:n_decode_total 999
"""


@pytest.mark.parametrize("exposition", [SPECSERVE, VLLM_TWO_ENGINES])
def test_vllm_style_counters_are_summed_over_label_sets(exposition):
    assert spec_counters(exposition) == {"drafts": 10.0, "draft_tokens": 40.0,
                                         "accepted_tokens": 25.0}


def test_llama_cpp_names_without_a_drafts_counter():
    assert spec_counters(LLAMA_CPP_OLD) == {"draft_tokens": 40.0, "accepted_tokens": 25.0}


def test_summary_is_computed_from_the_growth_between_scrapes():
    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 25.0}
    after = {"drafts": 30.0, "draft_tokens": 120.0, "accepted_tokens": 85.0}
    summary = speculation_summary(before, after)
    assert summary["num_drafts"] == 20 and summary["num_draft_tokens"] == 80
    assert summary["acceptance_rate"] == pytest.approx(60 / 80)
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 60 / 20)


def test_summary_without_drafts_or_counters():
    assert speculation_summary(None, None) is None
    assert speculation_summary({}, {}) is None
    idle = {"drafts": 5.0, "draft_tokens": 20.0, "accepted_tokens": 9.0}
    summary = speculation_summary(idle, dict(idle))  # nothing drafted during the run
    assert summary["acceptance_rate"] is None and summary["mean_acceptance_length"] is None
    old = speculation_summary({"draft_tokens": 0.0, "accepted_tokens": 0.0},
                              {"draft_tokens": 10.0, "accepted_tokens": 4.0})
    assert old["acceptance_rate"] == pytest.approx(0.4)
    assert old["mean_acceptance_length"] is None  # no drafts counter to divide by
