"""Qwen3 (dense) through the whole engine (issue 25, first family): greedy output equal to
transformers', alone and batched, and every proposer lossless on it, a Qwen3 draft model for a
Qwen3 target among them (the same-family pair users ask for). The layer-level logits are
compared in test_models.py ("qwen3-qk-norm")."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import (assert_alone_and_batched, assert_lossless, make_llm,
                            tiny_target_and_draft)

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
QWEN3 = dict(vocab_size=49152, head_dim=32, tie_word_embeddings=True, eos_token_id=2,
             bos_token_id=1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, default_model_folder):
    """A tiny Qwen3 target, a smaller Qwen3 as its draft (other weights: fewer layers), and the
    target's transformers outputs."""
    family = ("qwen3", QWEN3)
    return tiny_target_and_draft(tmp_path_factory, default_model_folder, family, family,
                                 PROMPTS, GREEDY.max_tokens)


def test_greedy_output_equals_transformers_alone_and_batched(qwen3):
    target, _, expected = qwen3
    assert_alone_and_batched(make_llm(str(target), speculative_method="none"), PROMPTS,
                             expected, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft", "eagle"])
def test_every_proposer_is_lossless_on_qwen3(qwen3, method):
    target, draft, expected = qwen3
    assert_lossless(target, draft, method, PROMPTS, expected, GREEDY)
