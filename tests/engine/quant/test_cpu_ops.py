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
from engine.sample import sampler
from tests.engine.quant.attention_inputs import attention_inputs


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


@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 49152])
def test_argmax_rows_is_torch_argmax_with_its_ties_and_nans(ops, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(8, width, generator=gen)
    x[1] = float("-inf")                       # all equal: index 0
    x[2] = x[2].round()                        # many ties: the first of them
    x[2, width // 2:] = x[2].max()
    x[3, width - 1] = float("nan")             # a NaN wins, as in torch
    x[4, width // 3] = float("nan")
    x[4, width - 1] = float("nan")             # the first NaN
    x[5, :] = 0.0
    x[5, width - 1] = 1.0                      # the last element, in the scalar tail
    x[6, width // 2] = float("inf")
    x[7] = torch.where(x[7] > 0, float("inf"), x[7])  # tied infinities
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(sampler.argmax_rows(x.view(2, 4, width)), x.view(2, 4, width).argmax(-1))
    # The negative control: the last of the ties is not what torch answers.
    if width > 2:
        assert ops.argmax_rows(x)[2] != width - 1


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




def _attention_float64(q, k_cache, v_cache, table, num_keys, window=0, scale=0.0, softcap=0.0):
    """One row's heads over its first num_keys keys (the last `window` of them where > 0), in
    float64: [heads, head_dim]."""
    num_kv_heads = k_cache.shape[2]
    first = max(0, num_keys - window) if window else 0
    keys = k_cache[table].flatten(0, 1)[first:num_keys].double()  # [n, kv_heads, D]
    values = v_cache[table].flatten(0, 1)[first:num_keys].double()
    group = q.shape[0] // num_kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), keys) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        scores = (scores / softcap).tanh() * softcap
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), values)


# Plain attention; a sliding window shorter than some contexts and longer than others, cutting
# key tiles and blocks mid-way; and Gemma 2's form (its own scale, soft-capped scores).
SCORE_FORMS = {"plain": {}, "window": {"window": 50},
               "gemma2": {"window": 70, "scale": 0.3, "softcap": 2.0}}


@pytest.mark.parametrize("form", list(SCORE_FORMS))
@pytest.mark.parametrize("head_dim", [64, 128, 24, 20])
def test_attention_rows_are_bitwise_the_same_alone_and_in_any_batch(ops, head_dim, threads,
                                                                    form):
    """Long contexts (the work is split over threads, in key tiles) and short ones (one thread),
    head sizes on the vector path (multiples of 8, over and under 64 columns) and off it (20),
    work items of one query head or of a whole GQA group (as threads and requests decide): every
    row equals float64 attention, and bitwise what it gives as the only row of its call."""
    query_lens, context_lens = [5, 1, 3, 40], [301, 77, 9, 70]
    num_heads, num_kv_heads = 9, 3
    q, k_cache, v_cache, token_index, block_tables = attention_inputs(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed=head_dim)
    batched = torch.full_like(q, float("nan"))
    options = SCORE_FORMS[form]
    ops.paged_attention_small(q, k_cache, v_cache, token_index, torch.tensor(query_lens),
                              torch.tensor(context_lens), block_tables, batched, **options)
    for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        for r in range(q_len):
            row = int(token_index[s, r])
            num_keys = ctx - q_len + r + 1
            alone = torch.full_like(q[:1], float("nan"))
            ops.paged_attention_small(q[row:row + 1].contiguous(), k_cache, v_cache,
                                      torch.tensor([[0]]), torch.tensor([1]),
                                      torch.tensor([num_keys]), block_tables[s:s + 1], alone,
                                      **options)
            assert torch.equal(alone[0], batched[row]), (s, r)
            expected = _attention_float64(q[row], k_cache, v_cache, block_tables[s], num_keys,
                                          **options)
            torch.testing.assert_close(batched[row].double(), expected, rtol=2e-5, atol=2e-5)
    # The negative control: one key fewer is a different result.
    fewer = torch.empty_like(q[:1])
    ops.paged_attention_small(q[:1].contiguous(), k_cache, v_cache, torch.tensor([[0]]),
                              torch.tensor([1]), torch.tensor([context_lens[0] - 5]),
                              block_tables[:1], fewer, **options)
    assert not torch.equal(fewer[0], batched[0])


def test_blocks_behind_the_window_are_never_read(ops):
    """Blocks wholly behind every query's window may have been given back: their table entries
    are not even checked. The same table without the window is refused (the control)."""
    q = torch.randn(2, 2, 8)
    cache = torch.randn(4, 4, 1, 8)
    args = (torch.tensor([[0, 1]]), torch.tensor([2]), torch.tensor([11]),
            torch.tensor([[10**6, 1, 2]]))  # keys 0-3 in a block id that does not exist
    out = torch.empty_like(q)
    ops.paged_attention_small(q, cache, cache, *args, out, window=6)
    expected = _attention_float64(q[1], cache, cache, torch.tensor([0, 1, 2]), 11, window=6)
    torch.testing.assert_close(out[1].double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention_small(q, cache, cache, *args, out)


def test_paged_attention_refuses_metadata_beyond_its_tables(ops):
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_attention_small(q, cache, cache, torch.tensor([[0]]), torch.tensor([1]),
                                  torch.tensor([9]), torch.tensor([[0, 1]]), torch.empty_like(q))


@pytest.mark.slow
def test_fused_decoder_layer_equals_the_python_layers(ops, monkeypatch, default_llm):
    """Decode steps of the default model through the compiled decoder stack and through the
    Python layers: the same tokens and log-probabilities (to float32 rounding)."""
    from engine import SamplingParams
    from engine.models.llama import LlamaForCausalLM

    if default_llm.engine.device.type != "cpu":
        pytest.skip("the fused layers are CPU float32 code; the default engine runs elsewhere")

    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    prompts = ["The capital of France is", "def add(a, b):\n    return"]
    stacks = []
    original = LlamaForCausalLM._decoder_stack

    def recording(self, fused, kv_caches):
        stacks.append(original(self, fused, kv_caches))
        return stacks[-1]

    monkeypatch.setattr(LlamaForCausalLM, "_decoder_stack", recording)
    fused = default_llm.generate(prompts, params)
    assert any(stack is not None for stack in stacks), "the compiled stack never ran"
    monkeypatch.setattr(LlamaForCausalLM, "_decoder_stack", lambda self, fused, kv_caches: None)
    python = default_llm.generate(prompts, params)
    for a, b in zip(fused, python):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_mask_logits_is_the_unpacked_masked_fill(ops):
    """The compiled grammar mask (new tensor or in place) equals unpacking the words and
    masked_fill, bitwise, with words
    all set, all clear, the sign bit, and a vocabulary that ends inside a word; the control:
    the bits read the other way round give another result."""
    from engine.grammar.masks import apply_allowed, unpack_bitmask

    vocab = 70  # two words and 6 bits of a third
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = torch.randint(-2**31, 2**31, (4, 3), dtype=torch.int32, generator=generator)
    bitmask[1, 0], bitmask[2, 1], bitmask[3, 2] = -1, 0, -2**31
    expected = apply_allowed(logits, unpack_bitmask(bitmask, vocab, torch.device("cpu")))
    ours = ops.mask_logits(logits, bitmask)
    assert torch.equal(ours, expected) and not torch.equal(ours, logits)
    assert torch.equal(logits, torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)))
    in_place = logits.clone()  # the in-place pass writes only refused tokens: the same result
    ops.mask_logits_(in_place, bitmask)
    assert torch.equal(in_place, expected)
    reversed_bits = torch.tensor([[int(f"{w & 0xFFFFFFFF:032b}"[::-1], 2) for w in row]
                                  for row in bitmask.tolist()], dtype=torch.int64)
    reversed_bits = ((reversed_bits + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert not torch.equal(ops.mask_logits(logits, reversed_bits), expected)
    with pytest.raises(RuntimeError, match="covering"):
        ops.mask_logits(torch.randn(4, 100), bitmask)
