"""Qwen3 (dense) through the whole engine (issue 25, first family): greedy output equal to
transformers', alone and batched, and every proposer lossless on it, a Qwen3 draft model for a
Qwen3 target among them (the same-family pair users ask for). The layer-level logits are
compared in test_models.py ("qwen3-qk-norm")."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.conftest import make_llm, make_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
QWEN3 = dict(vocab_size=49152, head_dim=32, tie_word_embeddings=True, eos_token_id=2,
             bos_token_id=1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, default_model_folder):
    """A tiny Qwen3 target, and a smaller Qwen3 as its draft (other weights: fewer layers)."""
    target = tmp_path_factory.mktemp("qwen3-target")
    hf_model = make_tiny_model(target, "qwen3", tokenizer_from=default_model_folder, **QWEN3)
    draft = tmp_path_factory.mktemp("qwen3-draft")
    make_tiny_model(draft, "qwen3", tokenizer_from=default_model_folder, num_hidden_layers=2,
                    **QWEN3)
    return target, draft, hf_model


@pytest.fixture(scope="module")
def plain(qwen3):
    target, _, _ = qwen3
    llm = make_llm(str(target), speculative_method="none")
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_greedy_output_equals_transformers_alone_and_batched(qwen3, plain):
    _, _, hf_model = qwen3
    llm, batched = plain
    tokenizer = llm.tokenizer
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == expected
    assert batched == expected
    assert len({tuple(e) for e in expected}) == len(PROMPTS)  # the prompts steer the output


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft"])
def test_every_proposer_is_lossless_on_qwen3(qwen3, plain, method):
    target, draft, _ = qwen3
    options = {"ngram": {}, "layer-skip": {"draft_layer_ids": (0, 2)},
               "draft": {"draft_model": str(draft)}}[method]
    llm = make_llm(str(target), speculative_method=method, adaptive=False,
                   num_speculative_tokens=4, **options)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == plain[1]
    assert sum(o.spec_stats.num_draft_tokens for o in outputs) > 0  # speculation really ran
