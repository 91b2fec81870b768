"""Row-invariant matrix products for the small steps of a GPU, as one Triton kernel.

Why: speculation is lossless only if a verified row's logits are bitwise those a one-row decode
step computes for the same token. cuBLAS picks its kernel (tile shape, split of the inner
dimension) from the number of rows, so in bfloat16 a 5-row verify step and a 1-row decode step
round some sums differently, and a near-tie's argmax can flip: on an H200 (bfloat16, greedy)
`suffix` left `none`'s tokens in 4 of 6 cells of spec_matrix; with this kernel and the attention
kernel's fixed 16-row programs, all 9 speculative cells gave `none`'s tokens (docs/gpu.md).

Here every product of at most MAX_ROWS rows runs one kernel whose tiling depends on the
weight's shape alone: 16-row tiles, the inner dimension summed 64 columns at a time in order,
no split. An output element is then the same sequence of float32 operations on the same inputs
whatever rows share its call. Past MAX_ROWS (prefill chunks, wide batches) the product is
compute-bound and cuBLAS's own choice is kept: prefill is cut the same way with speculation
and without, and a decode batch that wide is past what batch invariance promises (docs/gpu.md).

Where: with --batch-invariant (ModelConfig.batch_invariant; off by default), every projection
of the target on CUDA; float32 runs it too, in IEEE float32 (not TF32). It costs device time:
on an H200 a batch-1 step of SmolLM2-135M replayed in 1.20 ms against cuBLAS's 1.04, and a
step of the 8B-shaped model took 8.3 ms against 5.4 (2.1x and 1.35x the bandwidth limit;
docs/gpu.md). Its tiles are untuned: one loan measured them. Under Triton's interpreter
(TRITON_INTERPRET=1) the kernel runs on CPU tensors too, which is how the tests check it here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# The widest product this kernel takes: decode batches and verify steps (the padded steps that
# run the LM head inside their graph stop at the same 64 rows).
MAX_ROWS = 64
BLOCK_ROWS = 16  # fixed: a tile of another height may accumulate in another order
BLOCK_INNER = 64  # the inner dimension's chunk, summed in order (the default tiles')


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this product: 2-D, at most MAX_ROWS rows, on CUDA (or under the
    interpreter)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dim() == 2 and weight.stride(-1) == 1
            and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


@dataclass(frozen=True)
class Tiles:
    """How a product is cut: chosen from the weight's shape, never from the row count."""

    block_n: int  # output columns a program computes
    block_k: int = BLOCK_INNER  # inner columns summed a step
    num_warps: int = 4
    num_stages: int = 3


def block_columns(out_features: int) -> int:
    """Output columns per program, from the weight's shape only: enough programs to spread a
    one-row product over the GPU (~64 and up), at most 128 columns each."""
    per_64 = max(out_features // 64, 1)
    return min(128, max(16, 1 << (per_64.bit_length() - 1)))


def tiles_for(out_features: int, in_features: int) -> Tiles:
    """The tiles a weight of this shape runs with. Untuned (one loan measured them):
    benchmarks/experiments/invariant_tiles.py times the candidates on a GPU."""
    return Tiles(block_columns(out_features))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # The row count is not specialized on: Triton compiles a separate kernel for an argument
    # equal to 1, and one kernel for every row count is the point.
    @triton.jit(do_not_specialize=["num_rows"])
    def linear_kernel(
        x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, num_rows, out_features, in_features,
        stride_x, stride_w, stride_residual, stride_out,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        row_real = rows < num_rows
        column_real = columns < out_features
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, in_features, BLOCK_K):
            k = start + inner
            k_real = k < in_features
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=row_real[:, None] & k_real[None, :], other=0.0)
            w = tl.load(w_ptr + columns[None, :] * stride_w + k[:, None],
                        mask=column_real[None, :] & k_real[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + columns, mask=column_real, other=0.0).to(tl.float32)[None, :]
        mask = row_real[:, None] & column_real[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(residual_ptr + rows[:, None] * stride_residual + columns[None, :],
                           mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + columns[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)

    return linear_kernel


def linear(x: torch.Tensor,  # [rows, in], unit stride in `in`
           weight: torch.Tensor,  # [out, in], unit stride in `in`
           bias: torch.Tensor | None = None,  # [out]
           residual: torch.Tensor | None = None,  # [rows, out], added before rounding
           tiles: Tiles | None = None,  # None: tiles_for(weight's shape)
           ) -> torch.Tensor:  # [rows, out]: x W^T + bias + residual, in x's dtype
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    out = x.new_empty(num_rows, out_features)
    if num_rows == 0:
        return out
    tiles = tiles or tiles_for(out_features, in_features)
    grid = (-(-out_features // tiles.block_n), -(-num_rows // BLOCK_ROWS))
    _kernel()[grid](
        x, weight, bias if bias is not None else out, residual if residual is not None else out,
        out, num_rows, out_features, in_features, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=BLOCK_ROWS,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        # float32 stays float32, not TF32
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
