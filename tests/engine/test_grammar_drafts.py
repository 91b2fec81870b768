"""Drafts under a grammar from a proposer that can continue them (n-gram): the grammar's forced
tokens and the proposer's guesses alternate within one step, each guess made after the drafts
before it, within the step's budget, and the grammar's state is where it was afterwards."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.grammar import Constraint
from engine.grammar.drafts import interleave_drafts
from tests.conftest import make_llm
from tests.engine.test_structured_engine import (  # noqa: F401 (fixtures)
    CONSTRAINTS,
    PROMPTS,
    TOY_GRAMMAR,
    plain_structured,
    toy_compiler,
)


class Guesser:
    """Guesses a fixed continuation and records the drafts each guess was asked to follow."""

    def __init__(self, *guesses):
        self.guesses, self.calls = list(guesses), []

    def __call__(self, drafts, num_tokens, valid_prefix):
        self.calls.append(list(drafts))
        tokens = self.guesses.pop(0)[:num_tokens] if self.guesses else []
        return tokens[:valid_prefix(tokens)]


def test_forced_tokens_and_guesses_alternate(toy_compiler):
    # x: 1 | 3 4 | 5 | 4 1. After a 3 the grammar forces 4; after a 4 that starts an x, 1.
    matcher = toy_compiler.matcher(Constraint("grammar", TOY_GRAMMAR))
    guess = Guesser([5, 3], [1, 1, 1, 1])
    drafts, forced = interleave_drafts(matcher, guess, 6, 6)
    assert drafts == [5, 3, 4, 1, 1, 1] and forced == [False, False, True, False, False, False]
    assert guess.calls == [[], [5, 3, 4]]  # the second guess follows the forced 4
    # The state is where it was: nothing forced at the start, and 3 still needs its 4.
    assert matcher.forced_tokens() == []
    assert matcher.accept([3]) and matcher.forced_tokens() == [4]
    assert not matcher.accept([5])  # negative control: refused after 3


def test_forced_tokens_come_first_and_the_budgets_hold(toy_compiler):
    matcher = toy_compiler.matcher(Constraint("grammar", TOY_GRAMMAR))
    assert matcher.accept([3])
    # Forced drafts go even with no guesses planned ...
    assert interleave_drafts(matcher, Guesser([1, 1]), 4, 0) == ([4], [True])
    # ... and guesses stop at the controller's plan, and everything at the step's room.
    assert interleave_drafts(matcher, Guesser([4, 1, 5]), 6, 1) == ([4, 4, 1], [True, False, True])
    assert interleave_drafts(matcher, Guesser([1, 1, 1]), 2, 6) == ([4, 1], [True, False])
    # A proposer that ignores its limits is held to them: the room, and the grammar (5 is
    # refused after 3; the forced 4 follows instead).
    assert interleave_drafts(matcher, lambda d, n, v: [5] * 9, 4, 4) == (
        [4, 5, 5, 5], [True, False, False, False])
    assert interleave_drafts(matcher, lambda d, n, v: [3, 5, 1], 5, 5) == (
        [4, 3, 4, 3, 4], [True, False, True, False, True])
    assert matcher.forced_tokens() == [4]


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_lookup_steps_mix_forced_and_guessed_drafts_and_stay_lossless(method, plain_structured,
                                                                      monkeypatch):
    from engine.spec_decode import speculation

    expected, _ = plain_structured
    mixed = []
    original = speculation.interleave_drafts

    def recording(*args):
        drafts, forced = original(*args)
        mixed.append(any(forced) and not all(forced))
        return drafts, forced

    monkeypatch.setattr(speculation, "interleave_drafts", recording)
    # Not adaptive: the controller prices guesses by measured step times, and on a slow or
    # noisy host it may plan none, leaving only forced drafts (CI failed so, once).
    llm = make_llm(speculative_method=method, num_speculative_tokens=4, adaptive=False)
    params = [SamplingParams(max_tokens=40, temperature=0, structured=c) for c in CONSTRAINTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    # a second pass: the suffix cache now holds the first pass's outputs, and guesses them
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert any(mixed)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_forced_accepted_tokens <= stats.num_forced_draft_tokens
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
