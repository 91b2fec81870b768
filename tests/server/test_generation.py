"""Request-to-engine helpers without a server: default max_tokens, logit_bias, choice layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.errors import APIError
from server.generation import Prompt, plan_choices, sampling_params
from server.protocol import ChatCompletionRequest, CompletionRequest


def _context(max_model_len=100, vocab_size=1000):
    engine = SimpleNamespace(vocab_size=vocab_size,
                             validate=lambda ids, params, cache_salt="": (ids, params))
    return SimpleNamespace(max_model_len=max_model_len, max_sequence_tokens=max_model_len,
                           engine=engine)


def _chat(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


def test_chat_without_max_tokens_fills_the_rest_of_the_context():
    params = sampling_params(_context(), _chat(), Prompt([1] * 30), None, None)
    assert params.max_tokens == 70


def test_a_prompt_that_fills_the_context_is_400_naming_the_numbers():
    with pytest.raises(APIError) as error:
        sampling_params(_context(), _chat(), Prompt([1] * 100), None, None)
    assert error.value.status_code == 400
    assert "100 tokens" in error.value.message


def test_completions_default_to_16_tokens():
    assert CompletionRequest(prompt="x").max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).max_tokens is None


def test_logit_bias_keys_become_token_ids():
    body = _chat(logit_bias={"5": -100, "7": 2.5})
    params = sampling_params(_context(), body, Prompt([1]), 4, None)
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    with pytest.raises(APIError, match="outside the vocabulary"):
        sampling_params(_context(vocab_size=6), body, Prompt([1]), 4, None)


def test_choices_are_numbered_per_prompt_and_seeds_move_per_choice():
    body = _chat(seed=10, stop="END")
    prompts = [Prompt([1, 2]), Prompt([3])]
    params = [sampling_params(_context(), body, p, 4, None) for p in prompts]
    choices = plan_choices(_context(), prompts, params, n=3)
    assert [c.index for c in choices] == list(range(6))
    assert [c.prompt for c in choices] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert [c.params.seed for c in choices] == [10, 11, 12, 10, 11, 12]
    assert all(c.params.stop == ("END",) for c in choices)
