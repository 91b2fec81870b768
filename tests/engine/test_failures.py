"""Failures that belong to one request (engine/failures.py) and grammars that cannot run
(engine/grammar/probe.py), without a model: each request's failure is recorded and the others go
on; a failure of every request, or out of memory, is no one request's; a grammar past llguidance's
limits is refused when compiled, not after its first tokens. Each with its negative control."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.failures import verify_isolated
from engine.sample.nan_rows import nan_requests, zero_nan_rows
from engine.grammar import Constraint, GrammarCompiler, GrammarError
from engine.grammar.masks import allocate_bitmask, build_bitmask
from engine.sampling_params import SamplingParams


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(n)]


def _verify_failing(bad: set[str], error=ValueError("bad row")):
    def verify(requests, row_starts):
        if any(r.request_id in bad for r in requests):
            raise error
        return [[7] for _ in requests]
    return verify


def test_one_failing_request_fails_alone():
    requests, failed = _requests(3), {}
    emitted = verify_isolated(_verify_failing({"r1"}), requests, [0, 1, 2], failed)
    assert emitted == [[7], [], [7]] and set(failed) == {"r1"}
    assert "bad row" in failed["r1"]
    # Negative control: nothing fails, nothing is recorded.
    failed = {}
    assert verify_isolated(_verify_failing(set()), requests, [0, 1, 2], failed) == [[7]] * 3
    assert failed == {}


def test_a_failure_of_every_request_or_out_of_memory_is_no_ones():
    with pytest.raises(ValueError):
        verify_isolated(_verify_failing({"r0", "r1"}), _requests(2), [0, 1], {})
    with pytest.raises(torch.OutOfMemoryError):
        verify_isolated(_verify_failing({"r1"}, torch.OutOfMemoryError("CUDA out of memory")),
                        _requests(3), [0, 1, 2], {})


def test_nan_rows_fail_their_request_and_are_zeroed_where_the_batch_samples():
    requests = _requests(3)
    logits = torch.randn(3, 8)
    logits[1, 4] = float("nan")
    greedy = logits.clone()
    flags = zero_nan_rows(logits, any_sampled=True)
    assert not torch.isnan(logits).any() and logits[1].eq(0).all() and logits[0].ne(0).all()
    assert set(nan_requests(requests, [0, 1, 2], flags.read())) == {"r1"}
    # an all-greedy batch: flagged alike, its logits left as they are (an argmax stays in the
    # vocabulary and in its row)
    before = greedy.clone()
    flags = zero_nan_rows(greedy, any_sampled=False)
    assert set(nan_requests(requests, [0, 1, 2], flags.read())) == {"r1"}
    assert torch.equal(greedy.nan_to_num(), before.nan_to_num()) and greedy[1, 4].isnan()
    assert 0 <= int(greedy.argmax(dim=-1)[1]) < greedy.shape[1]
    clean = zero_nan_rows(torch.randn(3, 8), any_sampled=True)  # negative control
    assert nan_requests(requests, [0, 1, 2], clean.read()) == {}


@pytest.fixture(scope="module")
def compiler(default_model_folder):
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_folder), 49152, [2])


PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}}


@pytest.mark.parametrize("constraint", [
    Constraint.json_schema(PATTERN),  # fails only inside the one key's string
    Constraint("regex", "^a{1000000}$"),
    Constraint.json_schema({"type": "object", "properties": {  # a row of 2,407 items
        f"p{i}": {"type": "integer"} for i in range(600)}}),
], ids=["schema pattern", "regex", "600 optional properties"])
def test_a_grammar_that_cannot_run_is_refused_when_compiled(compiler, constraint):
    with pytest.raises(GrammarError, match="too many expressions|row has|lexer"):
        compiler.compile(constraint)
    with pytest.raises(GrammarError):  # and again, from the failed cache
        compiler.compile(constraint)


def test_the_same_shapes_within_limits_compile(compiler):
    """Negative control: a small repeat, 400 optional properties, 5,000 choices."""
    compiler.compile(Constraint.json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{3}$"}}}))
    compiler.compile(Constraint("regex", "^a{3}$"))
    compiler.compile(Constraint.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(400)}}))
    matcher = compiler.matcher(Constraint.choice([f"option {i}" for i in range(5_000)]))
    assert matcher.accept(compiler._hf_tokenizer("option 4321")["input_ids"])
    assert matcher.is_terminated or matcher.valid_prefix([2]) == 1


def test_a_grammar_gone_wrong_fails_its_request_not_the_batch(compiler):
    """A matcher in error raises when its masks are built; build_bitmask records that request
    and fills the others' rows. Control: the same batch without the broken one records nothing."""
    good = Request("good", [1], SamplingParams())
    good.grammar = compiler.matcher(Constraint("regex", "[a-z]+"))
    bad = Request("bad", [1], SamplingParams())
    bad.grammar = compiler.matcher(Constraint("regex", "[a-z]+"))
    digit = compiler._hf_tokenizer("7")["input_ids"]
    assert not bad.grammar.accept(digit)  # a token the grammar refuses: the matcher is in error
    failed = {}
    bitmask = build_bitmask([good, bad], [0, 1], 2, failed)
    assert set(failed) == {"bad"}
    assert (bitmask[1] == -1).all() and not (bitmask[0] == -1).all()
    failed = {}
    build_bitmask([good], [0], 1, failed)
    assert failed == {}
    with pytest.raises(GrammarError):  # without a record to write to, it raises
        build_bitmask([bad], [0], 1)
    assert allocate_bitmask(1, 2).shape == (1, 2)
