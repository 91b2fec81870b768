"""Qwen3-MoE (issue 25): routing as transformers routes (ties included), experts computed only for
the tokens routed to them (an expert no token chose does no work), greedy output through the
whole engine equal to transformers', and every proposer lossless, a dense Qwen3 draft for the
MoE target among them. Layer logits: test_models.py ("qwen3-moe", "qwen3-moe-dense-layer")."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.models.architecture import LlamaArchitecture
from engine.models.moe import SparseMoE, route
from tests.conftest import (assert_alone_and_batched, assert_lossless, make_llm,
                            tiny_target_and_draft)

PROMPTS = ["The capital of France is Paris. The capital of Italy is", "def add(a, b):\n    return",
           "one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
           norm_topk_prob=True, mlp_only_layers=[1])
TOKENIZER = dict(vocab_size=49152, eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)


def _moe_layer(num_experts=4, top_k=2, normalize=True) -> SparseMoE:
    arch = LlamaArchitecture(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=8,
        tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=1e4,
        rope_scaling=None, sparse_layers=(0,), num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=6, norm_topk_prob=normalize)
    layer = SparseMoE(arch)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _every_expert_on_every_token(layer: SparseMoE, x, normalize=True):
    """The dense reference: all experts on all tokens, then the routed ones weighted."""
    weights, experts = route(layer.gate(x), layer.top_k, normalize)
    outputs = torch.stack([expert(x) for expert in layer.experts], dim=1)  # [T, E, hidden]
    chosen = outputs.gather(1, experts.unsqueeze(-1).expand(-1, -1, x.shape[1]))
    return (chosen * weights.unsqueeze(-1)).sum(1)


def test_experts_run_only_on_their_tokens_and_an_unchosen_expert_does_nothing():
    layer = _moe_layer()
    with torch.no_grad():
        layer.gate.weight[3] = -100.0  # with positive inputs, never in any top 2
    x = torch.randn(7, 8).abs()
    calls = []
    for index, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda m, args, out, i=index: calls.append((i, len(args[0]))))
    with torch.no_grad():
        got = layer(x)
        own = list(calls)  # the layer's own calls, before the reference runs every expert
        torch.testing.assert_close(got, _every_expert_on_every_token(layer, x))
        # The negative control: the same experts weighted without renormalisation.
        assert not torch.allclose(got, _every_expert_on_every_token(layer, x, normalize=False))
    assert 3 not in dict(own)  # no token chose expert 3: it never ran
    assert sum(n for _, n in own) == 7 * 2  # each token's two choices, each computed once


def test_routing_ties_are_broken_as_transformers_breaks_them():
    """Two experts with the same router row tie for every token: the choice between them must
    be transformers' (torch.topk's), or the output differs."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = AutoConfig.for_model("qwen3_moe", hidden_size=8, num_experts=4,
                                  num_experts_per_tok=1, norm_topk_prob=False)
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.weight[2] = router.weight[1]
    x = torch.randn(64, 8)
    _, expected_weights, expected_experts = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    weights, experts = route(logits, 1, normalize=False)
    assert torch.equal(experts, expected_experts) and torch.equal(weights, expected_weights)
    assert {1, 2} & set(experts.flatten().tolist())  # the tied pair does get chosen


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, default_model_folder):
    """A tiny Qwen3-MoE, a dense Qwen3 draft, and the target's transformers outputs."""
    return tiny_target_and_draft(
        tmp_path_factory, default_model_folder, ("qwen3_moe", {**MOE, **TOKENIZER}),
        ("qwen3", dict(head_dim=32, **TOKENIZER)), PROMPTS, GREEDY.max_tokens)


def test_greedy_output_equals_transformers_alone_and_batched(qwen3_moe):
    target, _, expected = qwen3_moe
    llm = make_llm(str(target), speculative_method="none")
    assert llm.engine.runner.model.arch.sparse_layers == (0, 2)
    assert_alone_and_batched(llm, PROMPTS, expected, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft", "eagle"])
def test_every_proposer_is_lossless_on_qwen3_moe(qwen3_moe, method):
    target, draft, expected = qwen3_moe
    assert_lossless(target, draft, method, PROMPTS, expected, GREEDY)
