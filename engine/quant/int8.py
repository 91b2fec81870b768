"""The integer path for GGUF weights on CPU, in torch: the 16-row repacking the kernels read
(csrc/int8_layout.h has the layout), its inverse, the activation quantization, and a reference
matmul that follows the kernels' canonical order operation by operation, so it gives bitwise
their result. The reference is the kernels' test oracle and the fallback where they cannot build.
"""

from __future__ import annotations

import torch

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGUF type ids
Q4_0X16, Q4_1X16, Q8_0X16 = 1002, 1003, 1008  # the same weights repacked for the integer kernels
REPACKED = {Q4_0: Q4_0X16, Q4_1: Q4_1X16, Q8_0: Q8_0X16}
ORIGINAL = {v: k for k, v in REPACKED.items()}
GROUP = 16  # weight rows per group
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_SCALE_BYTES = {Q4_0: 2, Q4_1: 4, Q8_0: 2}  # fp16 d (and m) at the start of a GGUF block


def repackable(ggml_type: int, rows: int, in_features: int) -> bool:
    return ggml_type in REPACKED and rows % GROUP == 0 and in_features % 32 == 0


def repack(packed: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF rows [M, row_bytes] -> the same bytes reordered into 16-row groups."""
    rows, row_bytes = packed.shape
    block_bytes, scale_bytes = _BLOCK_BYTES[ggml_type], _SCALE_BYTES[ggml_type]
    num_blocks = row_bytes // block_bytes
    blocks = packed.reshape(rows // GROUP, GROUP, num_blocks, block_bytes).transpose(1, 2)
    groups, lanes = rows // GROUP, GROUP
    # fp16 fields: all 16 rows' d, then (Q4_1) all 16 rows' m
    scales = blocks[..., :scale_bytes].reshape(groups, num_blocks, lanes, -1, 2)
    scales = scales.transpose(2, 3).reshape(groups, num_blocks, -1)
    # quants: 4-byte chunk c of every row, row after row, chunk after chunk
    quants = blocks[..., scale_bytes:].reshape(groups, num_blocks, lanes, -1, 4)
    quants = quants.transpose(2, 3).reshape(groups, num_blocks, -1)
    return torch.cat([scales, quants], dim=-1).reshape(rows, row_bytes).contiguous()


def unpack(repacked: torch.Tensor, int_type: int) -> torch.Tensor:
    """The inverse of `repack`: GGUF rows [M, row_bytes] of type ORIGINAL[int_type]."""
    ggml_type = ORIGINAL[int_type]
    rows, row_bytes = repacked.shape
    block_bytes, scale_bytes = _BLOCK_BYTES[ggml_type], _SCALE_BYTES[ggml_type]
    num_blocks, groups = row_bytes // block_bytes, rows // GROUP
    grouped = repacked.reshape(groups, num_blocks, GROUP * block_bytes)
    scales = grouped[..., :GROUP * scale_bytes].reshape(groups, num_blocks, -1, GROUP, 2)
    scales = scales.transpose(2, 3).reshape(groups, num_blocks, GROUP, scale_bytes)
    quants = grouped[..., GROUP * scale_bytes:].reshape(groups, num_blocks, -1, GROUP, 4)
    quants = quants.transpose(2, 3).reshape(groups, num_blocks, GROUP, -1)
    blocks = torch.cat([scales, quants], dim=-1)  # [groups, blocks, 16, block_bytes]
    return blocks.transpose(1, 2).reshape(rows, row_bytes).contiguous()


def unpack_rows(repacked: torch.Tensor, int_type: int, ids: torch.Tensor) -> torch.Tensor:
    """GGUF rows `ids` (any shape; flattened) of a repacked weight: only their groups unpacked."""
    ids = ids.reshape(-1)
    groups = torch.unique(torch.div(ids, GROUP, rounding_mode="floor"))
    row_bytes = repacked.shape[1]
    picked = repacked.view(-1, GROUP, row_bytes).index_select(0, groups)
    gguf_rows = unpack(picked.reshape(-1, row_bytes), int_type)
    position = torch.searchsorted(groups, torch.div(ids, GROUP, rounding_mode="floor"))
    return gguf_rows.index_select(0, position * GROUP + ids % GROUP)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """x [N, K] float32 -> (q [N, K] int8, d [N, K/32], s [N, K/32] float32, sum [N, K/32] int32),
    as the kernels' quantize_rows and llama.cpp's on x86: per block q = round_half_even(x * 127 /
    max|x|), d = max|x| / 127 and s = d * sum(q), both rounded to fp16 (as Q8_0/Q8_1 store them)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    inverse = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int32)
    total = q.sum(dim=-1, dtype=torch.int32)
    scale = amax / 127.0
    return (q.to(torch.int8).reshape(x.shape), scale.half().float(),
            (scale * total.float()).half().float(), total)


def _weight_fields(repacked: torch.Tensor, int_type: int, in_features: int):
    """(integer weights [M, blocks, 32] float64, d [M, blocks], m [M, blocks] or None)."""
    gguf = unpack(repacked, int_type)
    rows, num_blocks = gguf.shape[0], in_features // 32
    blocks = gguf.reshape(rows, num_blocks, -1)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if int_type == Q4_0X16:  # weights 0..15, then 16..31, each stored + 8
        qs = blocks[..., 2:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).double() - 8.0, d, None
    if int_type == Q4_1X16:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        qs = blocks[..., 4:]
        values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # weights 0..15, then 16..31
        return values.double(), d, m
    return blocks[..., 2:].contiguous().view(torch.int8).double(), d, None


def reference_matmul(x: torch.Tensor, repacked: torch.Tensor, int_type: int) -> torch.Tensor:
    """x [N, K] @ W^T on the integer path, in the kernels' canonical order: [N, M] float32."""
    in_features = x.shape[-1]
    q, d_x, s_x, _ = quantize_rows(x.reshape(-1, in_features))
    values, d_w, m_w = _weight_fields(repacked, int_type, in_features)
    q_blocks = q.reshape(q.shape[0], -1, 32).double()  # [N, blocks, 32]
    # Exact integer sums (float64 holds them exactly), [blocks, N, M].
    isums = torch.matmul(q_blocks.transpose(0, 1), values.permute(1, 2, 0)).float()
    acc = torch.zeros(q.shape[0], repacked.shape[0], dtype=torch.float32)
    for b in range(values.shape[1]):
        product = d_w[:, b].unsqueeze(0) * d_x[:, b].unsqueeze(1)
        acc = acc + isums[b] * product
        if m_w is not None:
            acc = acc + m_w[:, b].unsqueeze(0) * s_x[:, b].unsqueeze(1)
    return acc.reshape(*x.shape[:-1], repacked.shape[0])
