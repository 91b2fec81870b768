"""Phi-3 through the whole engine (issue 25): greedy output equal to transformers', alone and
batched, past its sliding window; every proposer lossless, a draft of another family among them:
a Gemma 2 draft that shares the target's vocabulary is accepted, since the check compares
vocabularies, not names (a draft with another vocabulary is refused: test_spec_decode_engine.py).
LongRoPE's logits: test_models.py."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import (assert_alone_and_batched, assert_lossless, make_llm,
                            tiny_target_and_draft)

PROMPTS = ["The capital of France is Paris. The capital of Italy is Rome. The capital of",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
           "one two three one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
TOKENIZER = dict(vocab_size=49152, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                 tie_word_embeddings=True)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, default_model_folder):
    """A tiny Phi-3 (fused q/k/v and gate/up in its checkpoint, a 10-token window), a Gemma 2
    draft with the same tokenizer, and the target's transformers outputs."""
    return tiny_target_and_draft(
        tmp_path_factory, default_model_folder, ("phi3", dict(sliding_window=10, **TOKENIZER)),
        ("gemma2", dict(head_dim=16, **TOKENIZER)), PROMPTS, GREEDY.max_tokens)


def test_greedy_output_equals_transformers_alone_and_batched(phi3):
    target, _, expected = phi3
    llm = make_llm(str(target), speculative_method="none", block_size=4)
    assert llm.engine.block_manager.window == 10
    assert_alone_and_batched(llm, PROMPTS, expected, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft", "eagle"])
def test_every_proposer_is_lossless_on_phi3(phi3, method):
    target, draft, expected = phi3
    assert_lossless(target, draft, method, PROMPTS, expected, GREEDY, block_size=4)
