"""Pure functions that say which rows and columns of a loaded weight rank r of `world` keeps
(Megatron's layout), and that cut a `Linear` accordingly.

- QKV: by output rows, a rank's query heads and the key/value heads they read (GQA groups kept
  whole); where there are fewer KV heads than ranks, each KV head is replicated on the ranks
  whose query heads read it.
- O and down: by input columns (the rank's heads, its slice of the intermediate size); their
  outputs are partial sums, summed by one all-reduce (parallel_layers.RowParallelLinear).
- gate/up: by output rows, the same intermediate slice of gate and of up.
- embedding and LM head: by vocabulary rows, ceil(V / world) each (the last rank's may be
  shorter).
GGUF block weights are cut by rows as they are; by input columns on block boundaries, and
dequantized to float32 where a cut would split a block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.architecture import LlamaArchitecture
from engine.models.layers import Linear
from engine.quant.gguf_weight import PackedTensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadShard:
    q_heads: range  # global query-head indices this rank computes
    kv_heads: range  # global KV-head indices those query heads read


def check_shardable(arch: LlamaArchitecture, world: int) -> None:
    """Raises ValueError, in words a user can act on, where `world` ranks cannot split this
    model."""
    name = f"--tensor-parallel-size {world}"
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    if arch.num_heads % world:
        raise ValueError(f"{name} must divide the model's {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if kv >= world and kv % world or kv < world and world % kv:
        raise ValueError(f"{name} must divide the model's {kv} key/value heads, or be a "
                         f"multiple of them (each then replicated)")
    sizes = [("intermediate size", arch.intermediate_size)]
    if arch.num_experts:
        sizes.append(("expert intermediate size", arch.moe_intermediate_size))
    for what, size in sizes:
        if size % world:
            raise ValueError(f"{name} must divide the model's {what} {size}")


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    q_per_rank = num_heads // world
    q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
    if num_kv_heads >= world:
        kv_per_rank = num_kv_heads // world
        return HeadShard(q_heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    # Fewer KV heads than ranks: the one KV head this rank's query heads share (a GQA group
    # spans world / num_kv_heads ranks).
    kv = rank // (world // num_kv_heads)
    return HeadShard(q_heads, range(kv, kv + 1))


def qkv_rows(shard: HeadShard, num_heads: int, num_kv_heads: int,
             head_dim: int) -> list[range]:
    """Rows of the fused [q; k; v] projection this rank keeps, in q, k, v order."""
    k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return [_scaled(shard.q_heads, head_dim, 0), _scaled(shard.kv_heads, head_dim, k_start),
            _scaled(shard.kv_heads, head_dim, v_start)]


def o_columns(shard: HeadShard, head_dim: int) -> range:
    """Input columns of the O projection that this rank's heads produce."""
    return _scaled(shard.q_heads, head_dim, 0)


def intermediate_slice(size: int, rank: int, world: int) -> range:
    per_rank = size // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def gate_up_rows(size: int, rank: int, world: int) -> list[range]:
    """Rows of the fused [gate; up] projection: the same slice of each."""
    part = intermediate_slice(size, rank, world)
    return [part, range(size + part.start, size + part.stop)]


def vocab_sizes(vocab_size: int, world: int) -> list[int]:
    per_rank = -(-vocab_size // world)
    return [max(0, min(per_rank, vocab_size - r * per_rank)) for r in range(world)]


def vocab_rows(vocab_size: int, rank: int, world: int) -> range:
    start = sum(vocab_sizes(vocab_size, world)[:rank])
    return range(start, start + vocab_sizes(vocab_size, world)[rank])


def _scaled(heads: range, size: int, offset: int) -> range:
    return range(offset + heads.start * size, offset + heads.stop * size)


# ------------------------------------------------------------------ cutting a Linear
@torch.no_grad()
def cut_linear(linear: Linear, rows: list[range] | None = None, columns: range | None = None,
               keep_bias: bool = True, cls: type = Linear) -> Linear:
    """A new `cls` (a Linear) holding `rows` of W (in their order; None: all) and `columns`
    (None: all); the bias follows the rows, and is dropped where not `keep_bias` (the partial
    sums of a row-parallel layer add it once, on rank 0)."""
    rows = rows if rows is not None else [range(linear.out_features)]
    columns = columns if columns is not None else range(linear.in_features)
    out_features = sum(len(r) for r in rows)
    bias = linear.bias is not None and keep_bias
    cut = cls(len(columns), out_features, bias=bias)
    if linear.gguf is not None:
        _cut_gguf(linear, cut, rows, columns)
    else:
        weight = _take_rows(linear.weight, rows)[:, columns.start:columns.stop]
        cut.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias:
        cut.bias = nn.Parameter(_take_rows(linear.bias, rows).clone(), requires_grad=False)
    cut.row_invariant = linear.row_invariant
    # Which of the full layer's rows and columns this piece holds, in its order (`linear` is
    # always the whole layer: nothing is cut twice): per-rank loading (shard_load.py) reads
    # each checkpoint tensor's piece from these alone.
    cut.kept_rows, cut.kept_columns = list(rows), columns
    cut.dropped_bias = linear.bias is not None and not keep_bias
    return cut


def _take_rows(tensor: torch.Tensor, rows: list[range]) -> torch.Tensor:
    return torch.cat([tensor[r.start:r.stop] for r in rows])


def _cut_gguf(linear: Linear, cut: Linear, rows: list[range], columns: range) -> None:
    """Rows are whole packed rows; columns must start and end on block boundaries, or the
    cut weight is dequantized (correct, 4-8x the bytes)."""
    pieces = []  # (packed rows, format) in the cut's row order
    for wanted in rows:
        for part in linear.gguf.parts:
            start = max(wanted.start, part.out_offset)
            stop = min(wanted.stop, part.out_offset + part.rows)
            if start < stop:
                pieces.append((part.packed[start - part.out_offset:stop - part.out_offset],
                               part.fmt))
    full = columns.start == 0 and len(columns) == linear.in_features
    aligned = all(columns.start % fmt.block_size == 0 and len(columns) % fmt.block_size == 0
                  for _, fmt in pieces)
    if not full and not aligned:
        logger.info("a GGUF weight's column cut splits its blocks: kept dequantized")
        weight = torch.cat([PackedTensor(p, f.ggml_type, (p.shape[0], linear.in_features))
                            .dequantize() for p, f in pieces])
        cut.weight = nn.Parameter(weight[:, columns.start:columns.stop].contiguous(),
                                  requires_grad=False)
        return
    cut.keep_in_blocks()
    offset = 0
    for packed, fmt in pieces:
        if not full:
            first = columns.start // fmt.block_size * fmt.block_bytes
            packed = packed[:, first:first + fmt.row_bytes(len(columns))]
        # a copy, never a view: a view would keep the whole checkpoint tensor alive
        owned = torch.empty_like(packed, memory_format=torch.contiguous_format).copy_(packed)
        cut.gguf.add(PackedTensor(owned, fmt.ggml_type, (packed.shape[0], len(columns))), offset)
        offset += packed.shape[0]
