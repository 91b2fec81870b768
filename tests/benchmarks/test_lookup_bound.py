"""The lookup bound's arithmetic: how far a lookup could draft at each answer position, with and
without the token before as context, and the oracle's drafts cut there."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.experiments.lookup_bound import (OracleProposer, Turn, as_text, engine_options,
                                                 lookup_lengths, oracle_lengths)


def test_lengths_follow_the_longest_seen_run_of_the_answer():
    seen = as_text([1, 2, 3, 4, 9])
    # position 0 (after prompt token 1): 2 3 4 is seen after 1; then 5 is not.
    assert lookup_lengths(seen, [1], [2, 3, 4, 5], context=1) == [3, 2, 1, 0]
    # The control: without the token before, 3 4 occurs (after 2), but with it, after 5, no
    # seen text has 5 followed by anything.
    assert lookup_lengths(seen, [5], [3, 4], context=1) == [0, 1]
    assert lookup_lengths(seen, [5], [3, 4], context=0) == [2, 1]


def test_the_answer_so_far_and_the_prompt_count_as_seen_but_not_across_turns():
    # The answer repeats its own first tokens: 7 8 after 6 is found in answer[:3].
    assert lookup_lengths("", [6], [7, 8, 6, 7, 8], context=1) == [0, 0, 0, 2, 1]
    # A match may not run from one turn's text into the next one's.
    turns = [Turn("a", (1,), [2]), Turn("b", (3,), [9]), Turn("c", (5,), [2, 3])]
    lengths = oracle_lengths(turns, context=0)
    assert lengths[:2] == [[0], [0]]
    assert lengths[2] == [1, 1]  # "2" and "3" were seen, "2 3" only across turns 0 and 1


def test_the_oracle_drafts_the_answer_from_where_the_request_stands():
    oracle = OracleProposer()
    request = SimpleNamespace(num_output_tokens=1)
    oracle.serve([10, 11, 12, 13], [3, 2, 1, 0])
    assert oracle.propose([request], [5]).draft_token_ids == [[11, 12]]  # cut at lengths[1]
    assert oracle.propose([request], [1]).draft_token_ids == [[11]]  # and at what was asked
    oracle.serve([10, 11, 12, 13], None)  # the perfect proposer: not cut
    assert oracle.propose([request], [5]).draft_token_ids == [[11, 12, 13]]


def test_a_method_may_carry_engine_options():
    assert engine_options("suffix") == ("suffix", {})
    assert engine_options("suffix@num_speculative_tokens=24@suffix_min_token_prob=0.3") == (
        "suffix", {"num_speculative_tokens": 24, "suffix_min_token_prob": 0.3})
