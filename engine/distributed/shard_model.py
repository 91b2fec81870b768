"""Cuts a `LlamaForCausalLM` for one rank, in place: every projection replaced by its
rank's piece (shard.py), with the collectives of parallel_layers.py where outputs must be made
whole. Run by the loader's `shard` hook on every rank alike: on the meta device before a float
checkpoint is read (each cut records the full rows and columns it keeps, and shard_load.py
reads just those), or after a GGUF file's blocks are loaded, before a kernel packs them.
Every step here works on meta tensors."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from engine.distributed import shard
from engine.distributed.group import ParallelGroup
from engine.distributed.parallel_layers import (NoCompiledStack, ReducedExperts,
                                                RowParallelLinear, VocabParallelEmbedding,
                                                VocabParallelHead)
from engine.models.layers import MLP


def shard_model(model, group: ParallelGroup) -> None:
    """Raises ValueError where the model's heads or sizes do not divide among the ranks."""
    arch = model.arch
    shard.check_shardable(arch, group.world)
    heads = shard.head_shard(arch.num_heads, arch.num_kv_heads, group.rank, group.world)
    for layer in model.layers:
        _shard_attention(layer.self_attn, arch, heads, group)
        if isinstance(layer.mlp, MLP):
            _shard_mlp(layer.mlp, group, reduce=True)
        else:
            for expert in layer.mlp.experts:
                _shard_mlp(expert, group, reduce=False)
            layer.mlp = ReducedExperts(layer.mlp, group)
    _shard_vocabulary(model, group)
    model._compiled_stack = NoCompiledStack()
    # This rank's KV cache holds only its KV heads (model.kv_arch sizes every KVCache).
    model.kv_arch = replace(arch, num_heads=len(heads.q_heads), num_kv_heads=len(heads.kv_heads))


def _shard_attention(attn, arch, heads: shard.HeadShard, group: ParallelGroup) -> None:
    rows = shard.qkv_rows(heads, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    attn.qkv_proj = shard.cut_linear(attn.qkv_proj, rows=rows)
    attn.o_proj = _row_parallel(attn.o_proj, shard.o_columns(heads, arch.head_dim), group)
    attn.num_heads, attn.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
    attn.split_sizes = [len(r) for r in rows]


def _shard_mlp(mlp: MLP, group: ParallelGroup, reduce: bool) -> None:
    """A dense MLP's down projection all-reduces itself; an expert's does not (its layer sums
    all experts first: ReducedExperts)."""
    size = mlp.intermediate_size
    mlp.gate_up_proj = shard.cut_linear(
        mlp.gate_up_proj, rows=shard.gate_up_rows(size, group.rank, group.world))
    columns = shard.intermediate_slice(size, group.rank, group.world)
    mlp.down_proj = _row_parallel(mlp.down_proj, columns, group) if reduce else \
        shard.cut_linear(mlp.down_proj, columns=columns, keep_bias=group.is_leader)
    mlp.intermediate_size = len(columns)


def _row_parallel(linear, columns: range, group: ParallelGroup) -> RowParallelLinear:
    cut = shard.cut_linear(linear, columns=columns, keep_bias=group.is_leader,
                           cls=RowParallelLinear)
    cut.group = group
    return cut


def _shard_vocabulary(model, group: ParallelGroup) -> None:
    vocab = model.arch.vocab_size
    rows = shard.vocab_rows(vocab, group.rank, group.world)
    head = shard.cut_linear(model.lm_head, rows=[rows], cls=VocabParallelHead)
    head.group, head.vocab_start = group, rows.start
    head.vocab_sizes = shard.vocab_sizes(vocab, group.world)
    head.out_features = vocab  # the runner's vocabulary size: the gathered logits' width
    model.lm_head = head
    if model.embed_tokens is not None:
        weight = model.embed_tokens.weight.detach()[rows.start:rows.stop].clone()
        model.embed_tokens = VocabParallelEmbedding(weight, rows.start, group)
        model.embed_tokens.kept_rows = [rows]  # as cut_linear records them (shard_load.py)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lm_head", None), VocabParallelHead)
