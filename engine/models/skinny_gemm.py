"""Fused, row-invariant skinny GEMMs for the decode and verify steps of a GPU (1 to 64 rows), as
one Triton kernel in three epilogues. A decoder layer runs on four of them and the attention
kernel (fused_layer.py):
- `norm_qkv_rope`: RMSNorm in the prologue, the QKV product, RoPE on queries and keys, and the
  step's keys and values stored into their cache slots;
- `linear`: a projection with the residual added in the epilogue (O and down);
- `norm_gate_up_silu`: RMSNorm in the prologue, gate and up, silu(gate) * up in the epilogue.

Why: at batch 1 a step of the default model was 280 kernels of ~3 us while its weights stream in
0.07 ms (issue 71, H200); the torch path runs nine kernels a layer, this one five.

How a program works: it owns a block of output columns (for the paired epilogues, two blocks:
a head's first and second halves, or gate's and up's matching columns) for BLOCK_ROWS rows, and
sums the inner dimension BLOCK_K columns at a time, in order, with no split. The tiles come from
the weight's shape alone (skinny_tiles.py), so a row's result is bitwise the same whatever rows
share its call (row invariance; tests/engine/fused_cases.py checks it under Triton's
interpreter, with a row-count-dependent tiling as the negative control).

Rounding follows the torch path where it rounds between ops: the normalised activations are
rounded to the weights' dtype before the product (they are the product's operand), and the
paired epilogues round the projection before rotating or activating, as the torch path's
separate kernels read it back from memory; each then computes in float32 and rounds once.

Programmatic dependent launch: Triton 3.9 has `gdc_wait` and `launch_pdl`; with
SPECSERVE_PDL=1 every program waits on the previous kernel before its first load, so the launch
overlaps the previous kernel's tail. Off by default until a GPU has measured it.
"""

from __future__ import annotations

import functools
import os

import torch

from engine.core.cache_dir import use_triton_cache_dir
from engine.models.skinny_tiles import BLOCK_ROWS, Tiles, tiles_for

# The epilogues (literals inside the kernel: Triton reads no plain globals there).
PLAIN, SILU, ROPE = 0, 1, 2


def _use_pdl(x: torch.Tensor) -> bool:
    return os.environ.get("SPECSERVE_PDL") == "1" and x.device.type == "cuda" \
        and _kernels().HAS_PDL


@functools.cache
def _kernels():
    """The kernel's module, imported on first use: it imports triton."""
    use_triton_cache_dir()  # before the first compile
    from engine.models import skinny_kernel

    return skinny_kernel


def _launch(x, weight, out, grid_columns, tiles: Tiles, epilogue: int, pair_offset: int = 0,
            norm=None, eps=0.0, residual=None, rope=None, out_columns=None) -> torch.Tensor:
    num_rows = x.shape[0]
    if num_rows == 0:
        return out
    cos, sin, slots, k_cache, v_cache, num_heads, num_kv, head_dim = rope or (
        (out, out, out, out, out, 0, 0, 16))
    grid = (grid_columns, -(-num_rows // BLOCK_ROWS))
    kwargs = dict(launch_pdl=True) if _use_pdl(x) else {}
    _kernels().skinny_kernel[grid](
        x, norm if norm is not None else out, weight,
        residual if residual is not None else out, out, cos, sin, slots, k_cache, v_cache,
        num_rows, eps, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        cos.stride(0), k_cache.stride(1) if rope else 0, k_cache.stride(2) if rope else 0,
        K=x.shape[1], OUT_COLUMNS=out_columns or weight.shape[0], PAIR_OFFSET=pair_offset,
        EPILOGUE=epilogue, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        NUM_HEADS=num_heads, NUM_KV=num_kv, HEAD_DIM=head_dim, BLOCK_M=BLOCK_ROWS,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,  # float32 stays float32
        PDL=bool(kwargs), num_warps=tiles.num_warps, num_stages=tiles.num_stages, **kwargs)
    return out


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(x: torch.Tensor,  # [rows, in]
           weight: torch.Tensor,  # [out, in], unit stride in `in`
           residual: torch.Tensor | None = None,  # [rows, out], added before rounding
           tiles: Tiles | None = None,  # None: skinny_tiles.tiles_for(the weight's shape)
           ) -> torch.Tensor:  # [rows, out]: x W^T + residual
    out_features, in_features = weight.shape
    tiles = tiles or tiles_for("linear", out_features, in_features)
    out = x.new_empty(x.shape[0], out_features)
    residual = None if residual is None else _unit_stride(residual)
    return _launch(_unit_stride(x), weight, out, -(-out_features // tiles.block_n), tiles,
                   PLAIN, residual=residual)


def norm_gate_up_silu(x: torch.Tensor,  # [rows, hidden]
                      norm_weight: torch.Tensor,  # [hidden]
                      eps: float,
                      gate_up: torch.Tensor,  # [2 * intermediate, hidden]: gate's rows, then up's
                      tiles: Tiles | None = None,
                      ) -> torch.Tensor:  # [rows, intermediate]: silu(gate) * up of rms_norm(x)
    size = gate_up.shape[0] // 2
    tiles = tiles or tiles_for("gate_up", size, gate_up.shape[1])
    out = x.new_empty(x.shape[0], size)
    return _launch(_unit_stride(x), gate_up, out, -(-size // tiles.block_n), tiles, SILU,
                   pair_offset=size, norm=norm_weight, eps=eps, out_columns=size)


def norm_qkv_rope(x: torch.Tensor,  # [rows, hidden]
                  norm_weight: torch.Tensor,  # [hidden]
                  eps: float,
                  qkv: torch.Tensor,  # [(heads + 2 kv_heads) * head_dim, hidden]
                  cos: torch.Tensor,  # [rows, 1, head_dim] at each row's position
                  sin_rolled: torch.Tensor,  # [rows, 1, head_dim]: sin, its first half negated
                  num_heads: int,
                  k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], contiguous
                  v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor,  # [rows]
                  tiles: Tiles | None = None,
                  ) -> torch.Tensor:  # [rows, (heads + 2 kv_heads) * head_dim], rotated
    """Queries, keys and values of rms_norm(x), queries and keys rotated; keys and values also
    written to their cache slots."""
    num_kv, head_dim = k_cache.shape[2:]
    half = head_dim // 2
    tiles = tiles or tiles_for("qkv", qkv.shape[0] // 2, qkv.shape[1], half)
    if half % tiles.block_n:
        raise ValueError(f"a qkv tile of {tiles.block_n} columns does not divide half a head "
                         f"({half})")
    out = x.new_empty(x.shape[0], qkv.shape[0])
    rope = (cos, sin_rolled, slot_mapping, k_cache, v_cache, num_heads, num_kv, head_dim)
    return _launch(_unit_stride(x), qkv, out, (qkv.shape[0] // head_dim) * (half // tiles.block_n),
                   tiles, ROPE, pair_offset=half, norm=norm_weight, eps=eps, rope=rope)
