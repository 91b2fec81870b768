"""The structured-output benchmark, smoke-sized: its JSON workload compiles and checks outputs
against the right schemas, and a run reports valid outputs with `ngram` equal to `none`."""

from __future__ import annotations

import json

import pytest

from benchmarks.json_workload import SHAPES, is_valid, load_json_items


def test_json_workload_items_compile_and_check_their_schemas(default_llm):
    items = load_json_items(default_llm.tokenizer, 2)
    assert [item.shape for item in items] == list(SHAPES) * 2
    for item in items:
        default_llm.engine.grammars.compile(item.constraint)  # raises if it does not
    tools = next(item for item in items if item.shape == "tools")
    call = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    assert is_valid(json.dumps(call), tools.schema)
    # Negative controls: a call with a wrong argument, an unknown tool, text that is not JSON.
    assert not is_valid(json.dumps([{**call[0], "arguments": {"city": "Oslo"}}]), tools.schema)
    assert not is_valid(json.dumps([{"name": "nope", "arguments": {}}]), tools.schema)
    assert not is_valid('[{"name": ', tools.schema)


@pytest.mark.slow
def test_structured_benchmark_reports_valid_equal_outputs(tmp_path):
    from benchmarks.structured import main

    report = main(["--num-prompts", "2", "--shapes", "tools", "--max-tokens", "48",
                   "--concurrency", "2", "--output", str(tmp_path / "structured.json")])
    assert json.loads((tmp_path / "structured.json").read_text()) == report
    for mode in ("batch1", "batch1_prefix_caching"):
        every = report[mode]["all"]
        assert every["none"]["tokens"] > 0 and every["ngram"]["equal_to_none"] is True
        assert every["ngram"]["forced_draft_tokens"] > 0
        assert every["none"]["valid"] == every["none"]["finished"]
        assert 0 < every["none"]["prefill_seconds"] < every["none"]["seconds"]
    # The second prompt finds the tool schema's system message that the first left cached,
    # and never with prefix caching off.
    assert report["batch1_prefix_caching"]["all"]["none"]["cached_prompt_tokens"] > 0
    assert report["batch1"]["all"]["none"]["cached_prompt_tokens"] == 0
    assert 0 < report["concurrent"]["2"]["ngram"]["grammar_share_of_decode"] < 1


def test_each_method_goes_first_equally_often():
    """The order of turns rotates: over a multiple of the methods' number of prompts, each goes
    first (and each goes in each place) equally often; the control: a fixed order does not."""
    from collections import Counter

    from specserve.bench.report import taking_turns

    methods = ["none", "ngram", "eagle"]
    orders = [taking_turns(methods, n) for n in range(6)]
    assert all(sorted(order) == sorted(methods) for order in orders)
    for place in range(3):
        assert Counter(order[place] for order in orders) == {m: 2 for m in methods}
    assert Counter([methods[0]] * 6) != {m: 2 for m in methods}
