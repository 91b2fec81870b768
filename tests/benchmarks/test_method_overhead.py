"""benchmarks/experiments/method_overhead.py's cell: medians of interleaved runs against
`none`'s, the spread, drafts and proposer time per run, and whether every run's tokens were
`none`'s."""

from __future__ import annotations

import collections

from benchmarks.experiments.method_overhead import _cell, combine_processes
from benchmarks.experiments.own_off import turn_order


def test_a_cell_takes_medians_and_flags_other_tokens():
    tokens = [[1, 2], [3, 4]]
    runs = {"none": [(1.0, 0, tokens), (1.2, 0, tokens), (0.8, 0, tokens)],
            "eagle": [(1.25, 1, tokens), (1.0, 3, tokens), (2.0, 2, tokens)],
            "ngram": [(1.0, 0, tokens), (1.0, 0, [[1, 2], [3, 5]]), (1.0, 0, tokens)]}
    phases = {"eagle": collections.Counter(prepare=0.03, propose=0.006),
              "ngram": collections.Counter()}
    cell = _cell(runs, phases, tokens=100)
    assert cell["none"] == {"seconds_median": 1.0, "tokens_per_s": 100.0}
    eagle = cell["eagle"]
    assert eagle["ratio_vs_none"] == 0.8 and eagle["ratio_range"] == [0.5, 1.0]
    assert eagle["draft_tokens_per_run"] == 2
    assert eagle["proposer_ms_per_run"] == {"prepare": 10.0, "propose": 2.0}
    assert eagle["same_tokens_as_none"] is True
    assert cell["ngram"]["same_tokens_as_none"] is False  # the control: one run differed
    assert "none_spread" not in cell and "ratio_vs_nones" not in eagle  # no twins, no floor


def test_twins_of_none_give_the_noise_floor_and_a_median_to_compare_with():
    tokens = [[1]]
    runs = {"none": [(1.0, 0, tokens)], "none#2": [(1.1, 0, tokens)],
            "none#3": [(0.9, 0, tokens)], "ngram": [(1.1, 0, tokens)]}
    cell = _cell(runs, {"ngram": collections.Counter()}, tokens=10)
    assert cell["none_spread"] == {"none": 1.0, "none#2": 0.909, "none#3": 1.111}
    assert "none#2" not in cell  # a twin is not a method
    assert cell["ngram"]["ratio_vs_nones"] == 0.909  # against the median none (1.0 s)
    runs["none"] = [(0.5, 0, tokens)]  # one lucky engine moves ratio_vs_none far, the median less
    cell = _cell(runs, {"ngram": collections.Counter()}, tokens=10)
    assert cell["ngram"]["ratio_vs_none"] == 0.455 and cell["ngram"]["ratio_vs_nones"] == 0.818


def test_an_engine_against_itself_with_speculation_off():
    """`X/off` runs are not a method: they give X's `ratio_vs_own_off` (its engine's median
    with speculation off over its own), and whether they kept `none`'s tokens."""
    tokens = [[1]]
    runs = {"none": [(1.0, 0, tokens)], "ngram": [(1.25, 4, tokens), (1.0, 4, tokens)],
            "ngram/off": [(1.2, 0, tokens), (0.9, 0, [[2]])]}
    cell = _cell(runs, {"ngram": collections.Counter()}, tokens=10)
    assert "ngram/off" not in cell
    assert cell["ngram"]["ratio_vs_own_off"] == 0.933  # 1.05 s off, 1.125 s on
    assert cell["ngram"]["paired_ratio_vs_own_off"] == 0.93  # 0.96 and 0.9, run by run
    assert cell["ngram"]["fastest_ratio_vs_own_off"] == 0.9  # 0.9 s against 1.0
    assert cell["ngram"]["own_off_vs_none"] == 0.952
    assert cell["ngram"]["own_off_same_tokens_as_none"] is False  # the control: one run differed
    assert "ratio_vs_own_off" not in _cell({"none": runs["none"], "ngram": runs["ngram"]},
                                           {"ngram": collections.Counter()}, tokens=10)["ngram"]


def test_the_same_engine_runs_twice_as_none_and_pairs_alternate_who_goes_first():
    tokens = [[1]]
    runs = {"none": [(1.0, 0, tokens), (1.0, 0, tokens)],
            "none/off": [(1.1, 0, tokens), (0.8, 0, tokens)]}
    none = _cell(runs, {}, tokens=10)["none"]
    assert none["paired_ratio_vs_own_off"] == 0.95 and none["fastest_ratio_vs_own_off"] == 0.8
    assert len(_cell(runs, {}, tokens=10)) == 1  # the floor is no method
    groups = [["none", "none/off"], ["none#2"], ["ngram", "ngram/off"]]
    assert turn_order(groups, 0) == ["none", "none/off", "none#2", "ngram", "ngram/off"]
    assert turn_order(groups, 1) == ["none#2", "ngram/off", "ngram", "none/off", "none"]
    assert turn_order(groups, 2) == ["ngram", "ngram/off", "none", "none/off", "none#2"]


def test_speculation_off_steps_as_none_and_comes_back_on(tmp_path):
    """Inside `speculation_off` an `ngram` engine drafts nothing and gives the same tokens; after
    it, the same engine drafts again (the control: a prompt that repeats itself is drafted)."""
    from benchmarks.experiments.method_overhead import build_llm, run
    from benchmarks.experiments.own_off import speculation_off
    from engine import SamplingParams
    from engine.models.loader import resolve_model_folder

    _, name = resolve_model_folder(None)
    llm = build_llm("ngram", name, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt = [llm.engine.tokenizer.encode("Repeat exactly: one two three four five six seven "
                                          "eight. one two three four five six seven eight.")]
    speculation, at_prefill = llm.engine.speculation, llm.engine.scheduler.draft_at_prefill
    with speculation_off(llm):
        _, drafts_off, tokens_off = run(llm, prompt, params)
    _, drafts_on, tokens_on = run(llm, prompt, params)
    assert drafts_off == 0 and drafts_on > 0
    assert tokens_off == tokens_on
    assert llm.engine.speculation is speculation is not None
    assert llm.engine.scheduler.draft_at_prefill == at_prefill


def test_method_options_build_an_untrained_head_and_hold_retirement_off(tmp_path):
    """`eagle:random` drafts with an untrained head shaped like the shipped one and no copy
    lookup, and the target refuses its drafts; `:kept` holds that head's retirement off, the
    plain spec keeps it on. The control: the shipped head's drafts are accepted on the same
    prompt."""
    import pytest

    from benchmarks.experiments.method_overhead import build_llm
    from engine import SamplingParams
    from engine.models.loader import resolve_model_folder

    _, name = resolve_model_folder(None)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = ["Write a Python function that returns the sum of a list of numbers."]

    def accepted(spec: str, scratch) -> tuple[int, bool]:
        llm = build_llm(spec, name, scratch)
        output = llm.generate(prompt, params)[0]
        return output.spec_stats.num_accepted_tokens, llm.engine.proposer.retire

    untrained, retires = accepted("eagle:random", tmp_path / "a")
    assert retires and untrained == 0
    assert accepted("eagle:random:kept", tmp_path / "b")[1] is False
    shipped, _ = accepted("eagle", tmp_path / "c")
    assert shipped > 4
    with pytest.raises(SystemExit):
        build_llm("eagle:fast", name, tmp_path / "d")


def test_processes_give_each_method_the_median_of_their_ratios():
    """One process whose `eagle` engine landed badly (0.80) does not set the cell; the others'
    do. Control: a process whose tokens differed marks the cell."""
    def cell(ratio: float, same: bool = True) -> dict:
        return {"1": {"none": {}, "none_spread": {"none": 1.0},
                      "eagle": {"ratio_vs_nones": ratio, "draft_tokens_per_run": 2,
                                "same_tokens_as_none": same}}}

    combined = combine_processes([cell(0.99), cell(0.80), cell(1.01)], "ratio_vs_nones")
    eagle = combined["1"]["eagle"]
    assert eagle["ratio_median"] == 0.99 and eagle["ratios"] == [0.99, 0.80, 1.01]
    assert eagle["same_tokens_as_none"] is True and eagle["draft_tokens_per_run"] == [2, 2, 2]
    assert combined["1"]["none_spread"] == [{"none": 1.0}] * 3
    assert "none" not in combined["1"]
    other = combine_processes([cell(0.99), cell(0.99, same=False)], "ratio_vs_nones")
    assert other["1"]["eagle"]["same_tokens_as_none"] is False
