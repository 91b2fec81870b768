"""The fused float32 CPU ops (cpu_ops.cpp) against the torch code they replace on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import torch_backend
from engine.attention.metadata import build_attention_metadata
from engine.models import layers
from engine.models.architecture import LlamaArchitecture
from engine.quant.kernels import cpu_ops_for, load_kernel


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops_for(torch.empty(0))
    if module is None:
        pytest.skip("the CPU extension is not built")
    return module


def without_fused_ops(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setattr(module, "cpu_ops_for", lambda x: None)


def test_fused_ops_apply_only_to_cpu_float32():
    assert cpu_ops_for(torch.empty(0, dtype=torch.bfloat16)) is None
    assert cpu_ops_for(torch.empty(0)) is load_kernel()


def test_rms_norm(ops, monkeypatch):
    norm = layers.RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x = torch.randn(5, 96) * 3
    fused = norm(x)
    without_fused_ops(monkeypatch, layers)
    torch.testing.assert_close(fused, norm(x), rtol=1e-5, atol=1e-5)


def test_silu_mul(ops):
    # 43 columns: five 8-wide vectors and a scalar tail; the extremes reach the vector exp's
    # clamps (exp overflows float32 beyond ~88.7).
    gate_up = torch.randn(4, 2 * 43) * 4
    gate_up[0, :6] = torch.tensor([-120.0, -88.0, -30.0, 30.0, 88.0, 120.0])
    gate_up[1, :3] = torch.tensor([0.0, -1e-6, 1e-6])
    gate, up = gate_up.split(43, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def _arch(num_heads=6, num_kv_heads=2, head_dim=16) -> LlamaArchitecture:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, num_hidden_layers=1,
                         intermediate_size=32, vocab_size=64, max_position_embeddings=128)
    return LlamaArchitecture.from_hf_config(config)


def test_rotary_in_place_on_views_of_one_projection(ops, monkeypatch):
    """The fused rotation, in place on q and k as views of the fused projection, equals the torch
    path's rotation of q and k together (pre-rolled sin)."""
    arch = _arch()
    rotary = layers.RotaryEmbedding(arch)
    positions = torch.tensor([0, 5, 6, 127])
    qkv = torch.randn(4, (6 + 2 + 2) * 16)
    qk = qkv.clone()[:, :128].view(4, 8, 16)
    fused_step = rotary.at(positions, torch.float32)
    assert fused_step.fused is ops
    fused = fused_step.rotate(qk, num_heads=6)
    assert fused.data_ptr() == qk.data_ptr()  # in place
    monkeypatch.setattr(layers, "cpu_ops_on", lambda device, dtype: None)
    torch_step = rotary.at(positions, torch.float32)
    assert torch_step.fused is None
    expected = torch_step.rotate(qkv[:, :128].view(4, 8, 16), num_heads=6)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    # Both equal the textbook rotation of q and k apart.
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    plain = qkv[:, :128].view(4, 8, 16)
    textbook = plain * cos + layers.rotate_half(plain) * sin
    torch.testing.assert_close(expected, textbook, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1], [3, 1, 6], [2, 40, 1]])
def test_paged_attention_of_short_queries(ops, monkeypatch, query_lens):
    """Decode rows, verify rows and a prefill chunk in one batch, over shuffled blocks with GQA:
    the fused attention equals the torch path row for row."""
    gen = torch.Generator().manual_seed(len(query_lens))
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 16, 4
    context_lens = [q + extra for q, extra in zip(query_lens, [7, 0, 12])]
    block_ids = torch.randperm(40, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(block_ids[used:used + n])
        used += n
    k_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, q.device)
    fused = torch_backend.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    without_fused_ops(monkeypatch, torch_backend)
    expected = torch_backend.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_refuses_metadata_beyond_its_tables(ops):
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_attention_small(q, cache, cache, torch.tensor([[0]]), torch.tensor([1]),
                                  torch.tensor([9]), torch.tensor([[0, 1]]), torch.empty_like(q))


@pytest.mark.slow
def test_fused_decoder_layer_equals_the_python_layers(ops, monkeypatch, default_llm):
    """Decode steps of the default model through the one-call fused layers and through the
    Python layers: the same tokens and log-probabilities (to float32 rounding)."""
    from engine import SamplingParams
    from engine.models.llama import DecoderLayer

    if default_llm.engine.device.type != "cpu":
        pytest.skip("the fused layers are CPU float32 code; the default engine runs elsewhere")

    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    prompts = ["The capital of France is", "def add(a, b):\n    return"]
    calls = []
    monkeypatch.setattr(type(default_llm.engine.runner.model), "_fused_decode",
                        _counting(calls, type(default_llm.engine.runner.model)._fused_decode))
    fused = default_llm.generate(prompts, params)
    assert calls, "the fused layer path never ran"
    monkeypatch.setattr(DecoderLayer, "fused_weights", lambda self: None)
    python = default_llm.generate(prompts, params)
    for a, b in zip(fused, python):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def _counting(calls, method):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)
    return wrapper
