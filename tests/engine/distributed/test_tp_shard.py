"""The pure cuts of engine/distributed/shard.py, without processes: which heads, rows and columns
each rank keeps, and that the pieces put back together are the whole (rows concatenated, column
pieces' partial products summed), for float and GGUF block weights alike."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import shard
from engine.models.layers import Linear
from engine.quant.formats import quantize_q8_0
from engine.quant.gguf_weight import PackedTensor


def test_gqa_groups_stay_whole_and_few_kv_heads_are_replicated():
    # 8 query heads, 4 KV heads, 2 ranks: query heads 0-3 read KV heads 0-1
    assert shard.head_shard(8, 4, 0, 2) == shard.HeadShard(range(0, 4), range(0, 2))
    assert shard.head_shard(8, 4, 1, 2) == shard.HeadShard(range(4, 8), range(2, 4))
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 share KV head 0, ranks 2-3 KV head 1
    assert [shard.head_shard(8, 2, r, 4).kv_heads for r in range(4)] == \
        [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    for rank in range(4):  # each query head's KV head (h // 4) is among the rank's
        heads = shard.head_shard(8, 2, rank, 4)
        assert {h // 4 for h in heads.q_heads} == set(heads.kv_heads)


def test_models_the_ranks_cannot_split_are_refused_in_words():
    from tests.engine.distributed.test_tp_logits import _arch

    with pytest.raises(ValueError, match="must divide the model's 9 attention heads"):
        shard.check_shardable(_arch(num_heads=9, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="must divide the model's 3 key/value heads"):
        shard.check_shardable(_arch(num_heads=12, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate size 102"):
        shard.check_shardable(_arch(intermediate_size=102), 4)
    shard.check_shardable(_arch(num_heads=12, num_kv_heads=3, intermediate_size=96), 3)
    shard.check_shardable(_arch(num_heads=8, num_kv_heads=2), 4)  # KV heads replicated


def test_vocabulary_pieces_cover_it_once():
    assert shard.vocab_sizes(255, 2) == [128, 127]
    assert [shard.vocab_rows(255, r, 2) for r in range(2)] == [range(0, 128), range(128, 255)]
    assert sum(shard.vocab_sizes(49152, 3)) == 49152


def _linear(out_features: int, in_features: int, gguf: bool) -> Linear:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    linear = Linear(in_features, out_features, bias=True)
    linear.bias.data.normal_()
    if gguf:
        linear.keep_in_blocks()
        linear.load("weight", PackedTensor(quantize_q8_0(weight), 8, tuple(weight.shape)))
    else:
        linear.weight.data.copy_(weight)
    return linear


@pytest.mark.parametrize("gguf", [False, True])
def test_column_pieces_sum_to_the_whole_product(gguf):
    """O and down: each rank's columns give a partial product; their sum (the all-reduce) plus
    the one bias is the whole layer's output. Columns of 32 are Q8_0 block boundaries; a cut of
    16 splits its blocks and is dequantized, with the same result."""
    linear = _linear(8, 128, gguf)
    x = torch.randn(5, 128)
    for width in (32, 16):
        pieces = [shard.cut_linear(linear, columns=range(start, start + width),
                                   keep_bias=start == 0) for start in range(0, 128, width)]
        assert all((p.gguf is not None) == (gguf and width == 32) for p in pieces)
        got = sum(p(x[:, i * width:(i + 1) * width]) for i, p in enumerate(pieces))
        torch.testing.assert_close(got, linear(x), atol=1e-4, rtol=1e-4)
    # negative control: a piece given the wrong columns of x
    wrong = sum(p(x[:, ((i + 1) % 4) * 32:((i + 1) % 4 + 1) * 32]) for i, p in enumerate(
        [shard.cut_linear(linear, columns=range(s, s + 32), keep_bias=s == 0)
         for s in range(0, 128, 32)]))
    assert (wrong - linear(x)).abs().max() > 1e-2


@pytest.mark.parametrize("gguf", [False, True])
def test_row_pieces_are_the_rows_they_name(gguf):
    """QKV and gate/up: a rank's rows, in the order asked, bias included."""
    linear = _linear(12, 64, gguf)
    x = torch.randn(3, 64)
    rows = [range(2, 4), range(8, 12)]
    cut = shard.cut_linear(linear, rows=rows)
    assert (cut.gguf is not None) == gguf
    whole = linear(x)
    torch.testing.assert_close(cut(x), torch.cat([whole[:, 2:4], whole[:, 8:12]], dim=1),
                               atol=1e-5, rtol=1e-5)
    one_range = shard.cut_linear(linear, rows=[range(4, 8)])
    held = one_range.weight if not gguf else one_range.gguf.parts[0].packed
    # the piece owns its bytes: a view would keep the whole weight alive on every rank
    assert held.untyped_storage().nbytes() == held.numel() * held.element_size()


def test_qkv_rows_take_each_ranks_heads_from_q_k_and_v():
    heads = shard.head_shard(4, 2, 1, 2)
    assert shard.qkv_rows(heads, 4, 2, 16) == [range(32, 64), range(64 + 16, 64 + 32),
                                               range(96 + 16, 96 + 32)]
    assert shard.o_columns(heads, 16) == range(32, 64)
    assert shard.gate_up_rows(128, 1, 2) == [range(64, 128), range(192, 256)]
