"""GGUF block formats: their sizes, and dequantization as pure tensor functions.

A packed weight is a uint8 tensor [rows, row_bytes], each row K weights stored as K / block_size
blocks exactly as the GGUF file holds them. These functions are the reference the compiled kernel
is tested against and the fallback where it cannot be built; they follow the format's definition
(ggml-common.h), written here from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant import int8


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # the id GGUF files store
    block_size: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_size:
            raise ValueError(f"{self.name}: {in_features} weights per row is not a multiple of "
                             f"the block size {self.block_size}")
        return in_features // self.block_size * self.block_bytes


FORMATS = {f.ggml_type: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q6_K", 14, 256, 210),
)}
FORMATS_BY_NAME = {f.name: f for f in FORMATS.values()}
# The same formats repacked in 16-row groups for the integer kernels (engine/quant/int8.py): same
# block sizes and bytes, other ids.
FORMATS.update({f.ggml_type: f for f in (
    BlockFormat("Q4_0x16", int8.Q4_0X16, 32, 18),
    BlockFormat("Q4_1x16", int8.Q4_1X16, 32, 20),
    BlockFormat("Q8_0x16", int8.Q8_0X16, 32, 34),
)})

# Byte offsets of each format's float16 scale fields inside a block (the rest are quantized
# values or 6-bit scales, valid whatever their bits).
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(fmt: BlockFormat, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """[rows, row_bytes] of random valid blocks (float16 scales in [1e-3, 2.1e-2]): weights for
    kernel tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rows * in_features // fmt.block_size
    blocks = torch.randint(0, 256, (num_blocks, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    for offset in FP16_FIELDS[fmt.name]:
        scales = (torch.rand(num_blocks, generator=gen) * 0.02 + 1e-3).half()
        blocks[:, offset:offset + 2] = scales.view(torch.uint8).view(num_blocks, 2)
    return blocks.reshape(rows, fmt.row_bytes(in_features))


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:  # [B, bytes] -> [B, 1] float32
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [B, n] uint8 -> [B, 2n]: low nibbles, high
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b, 0) * (_nibbles(b[:, 2:]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]) * _fp16(b, 0) + _fp16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _fp16(b, 0), _fp16(b, 2)
    s = b[:, 4:16].long()  # 12 bytes: 8 six-bit scales and 8 six-bit mins
    scales = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2j (low), 2j+1 (high)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    return (d * scales.float()).unsqueeze(-1) * q - (dmin * mins.float()).unsqueeze(-1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 64).long()
    qh = b[:, 128:192].reshape(-1, 2, 32).long()
    scales = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 8)
    d = _fp16(b, 208).unsqueeze(-1)  # [B, 1, 1]
    lo, hi = ql[..., :32], ql[..., 32:]
    q = torch.cat([  # the 4 runs of 32 weights of each half
        (lo & 0x0F) | ((qh & 3) << 4),
        (hi & 0x0F) | (((qh >> 2) & 3) << 4),
        (lo >> 4) | (((qh >> 4) & 3) << 4),
        (hi >> 4) | (((qh >> 6) & 3) << 4),
    ], dim=-1).float() - 32  # [B, 2, 128]
    scale_per_weight = scales.repeat_interleave(16, dim=-1)  # 8 sub-blocks of 16 per half
    return (d * scale_per_weight * q).reshape(-1, 256)


_DEQUANTIZERS = {2: _q4_0, 3: _q4_1, 8: _q8_0, 12: _q4_k, 14: _q6_k}


def dequantize(packed: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """[rows, row_bytes] uint8 -> [rows, in_features] float32."""
    fmt = FORMATS[ggml_type]
    if packed.shape[-1] != fmt.row_bytes(in_features):
        raise ValueError(f"{fmt.name}: rows of {packed.shape[-1]} bytes cannot hold "
                         f"{in_features} weights")
    if ggml_type in int8.ORIGINAL:
        packed, ggml_type = int8.unpack(packed, ggml_type), int8.ORIGINAL[ggml_type]
    blocks = packed.reshape(-1, fmt.block_bytes)
    return _DEQUANTIZERS[ggml_type](blocks).reshape(packed.shape[0], in_features)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[rows, in_features] float -> [rows, row_bytes] Q8_0 blocks: per 32 weights a float16
    scale d = max|w| / 127 and the weights as round(w / d) in int8: ggml's reference rule,
    byte for byte."""
    rows, in_features = weight.shape
    blocks = weight.detach().float().cpu().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = blocks * inverse
    whole = scaled.abs().floor()  # rounded half away from zero, as ggml's roundf
    q = (scaled.sign() * (whole + (2 * (scaled.abs() - whole)).floor())).to(torch.int8)
    packed = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return packed.reshape(rows, FORMATS[8].row_bytes(in_features)).to(weight.device)
