"""Gemma 2 and Gemma 3 (text) through the whole engine (issue 25): greedy output equal to
transformers', alone and batched, past their sliding windows; every proposer lossless on them; and
each Gemma difference shown to matter (dropping any one of them changes the logits). The layer
logits are compared on every attention path in test_models.py ("gemma2", "gemma3")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.core.kv_cache import KVCache
from engine.models import loader
from engine.models.architecture import LlamaArchitecture
from tests.conftest import (
    assert_alone_and_batched,
    assert_lossless,
    make_llm,
    make_tiny_model,
    tiny_target_and_draft,
)
from tests.engine.test_models import FAMILIES, _run_paged

PROMPTS = ["The capital of France is Paris. The capital of Italy is Rome. The capital of",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
           "one two three one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=20, temperature=0)
TOKENIZER = dict(vocab_size=49152, eos_token_id=2, bos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory, default_model_folder):
    """A tiny target of the family, a smaller draft of the same family, and the target's
    transformers outputs."""
    model_type, overrides = FAMILIES[request.param]
    family = (model_type, {**overrides, **TOKENIZER})
    return tiny_target_and_draft(tmp_path_factory, default_model_folder, family, family,
                                 PROMPTS, GREEDY.max_tokens)


def test_greedy_output_equals_transformers_alone_and_batched(gemma):
    target, _, expected = gemma
    llm = make_llm(str(target), speculative_method="none", block_size=4)
    assert_alone_and_batched(llm, PROMPTS, expected, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft", "eagle"])
def test_every_proposer_is_lossless_on_gemma(gemma, method):
    target, draft, expected = gemma
    assert_lossless(target, draft, method, PROMPTS, expected, GREEDY, block_size=4)


# Each Gemma difference, dropped: the logits must then leave transformers'.
DROPPED = {
    "gemma2": ["attn_softcap", "final_softcap", "layer_windows", "norm_weight_offset",
               "attention_scale", "embed_scale", "sandwich_norms", "hidden_act"],
    "gemma3": ["local_rope", "layer_windows", "qk_norm"],
}
PLAIN_VALUES = {"layer_windows": (), "norm_weight_offset": 0.0, "sandwich_norms": False,
                "hidden_act": "silu", "qk_norm": False}


@pytest.mark.parametrize("family,field", [(f, d) for f, ds in DROPPED.items() for d in ds])
def test_each_gemma_difference_matters(tmp_path, monkeypatch, family, field):
    model_type, overrides = FAMILIES[family]
    hf_model = make_tiny_model(tmp_path, model_type, **overrides)
    read = LlamaArchitecture.from_hf_config.__func__
    dropped = {field: PLAIN_VALUES.get(field)}
    monkeypatch.setattr(LlamaArchitecture, "from_hf_config", classmethod(
        lambda cls, config: dataclasses.replace(read(cls, config), **dropped)))
    if field in ("sandwich_norms", "qk_norm"):  # the norms' weights then have no place
        with pytest.raises(ValueError, match="has no place"):
            loader.load_model(str(tmp_path), torch.device("cpu"), torch.float32,
                              with_tokenizer=False)
        return
    model = loader.load_model(str(tmp_path), torch.device("cpu"), torch.float32,
                              with_tokenizer=False).model
    torch.manual_seed(1)
    token_ids = torch.randint(0, 256, (40,)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0]
    cache = KVCache(model.arch, num_blocks=32, block_size=4, dtype=torch.float32,
                    device=torch.device("cpu"))
    got = _run_paged(model, token_ids, list(range(10)), cache, chunks=[17, 5, 9] + [1] * 9)
    assert (got - expected).abs().max() > 1e-2

