"""The soak's mixed traffic (specserve/bench/mixed.py): every request shape is in it, whole
requests are not streamed, and the answer check finds what breaks a request (each check with the
answer that passes it beside the one that does not)."""

from __future__ import annotations

import json

from specserve.bench.load import RequestOptions, Target, request_body
from specserve.bench.mixed import FLAVOURS, answer_violation
from specserve.bench.workloads import load_workloads

STRUCTURED = next(f.extra for f in FLAVOURS if f.name == "json-whole")
TOOLS_REQUIRED = next(f.extra for f in FLAVOURS if f.name == "tools-required")
TOOLS_AUTO = next(f.extra for f in FLAVOURS if f.name == "tools-auto-stream")


def test_every_flavour_in_turn_with_its_request_fields():
    workloads = load_workloads("mixed", 10_000)
    flavours = [workload.id.split("/")[1] for workload in workloads]
    assert flavours[:len(FLAVOURS)] == [flavour.name for flavour in FLAVOURS]
    assert len(workloads) >= 24 * len(FLAVOURS)
    target = Target("t", "http://x", "m")
    for workload, flavour in zip(workloads, FLAVOURS):
        path, body = request_body(target, workload, RequestOptions("auto", 64))
        assert path == ("/v1/completions" if flavour.raw else "/v1/chat/completions")
        assert body["stream"] is flavour.stream
        assert ("stream_options" in body) is flavour.stream  # not allowed on whole requests
        for key, value in (flavour.extra or {}).items():
            assert body[key] == value


def test_a_structured_answer_must_parse_under_its_schema():
    good = json.dumps({"summary": "a question on trains", "topics": ["travel"]})
    assert answer_violation(STRUCTURED, good, [], "stop") is None
    for bad in ('{"summary": "x"}', '{"summary": "x", "topics": [], "extra": 1}', "not json",
                json.dumps({"summary": "x" * 61, "topics": []})):
        assert "breaks its schema" in answer_violation(STRUCTURED, bad, [], "stop")
    # cut at max_tokens: the JSON is a prefix, not a violation
    assert answer_violation(STRUCTURED, '{"summary": "a q', [], "length") is None


def test_a_required_tool_call_must_exist_and_fit_its_parameters():
    good = [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]
    assert answer_violation(TOOLS_REQUIRED, "", good, "tool_calls") is None
    assert "no tool call" in answer_violation(TOOLS_REQUIRED, "Hello", [], "stop")
    assert answer_violation(TOOLS_REQUIRED, "", [], "length") is None  # no room to finish it
    assert "unknown tool" in answer_violation(TOOLS_REQUIRED, "", [("rm", "{}")], "tool_calls")
    bad = [("get_weather", '{"city": "Oslo", "unit": "kelvin"}')]
    assert "break its parameters" in answer_violation(TOOLS_REQUIRED, "", bad, "tool_calls")
    # under "auto" the output is parsed, not constrained: text or a loose call is no violation
    assert answer_violation(TOOLS_AUTO, "Hello", bad, "stop") is None
    assert answer_violation(None, "anything", [], "stop") is None
