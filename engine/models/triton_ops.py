"""Fused decoder ops for GPUs, as Triton kernels: fewer, larger kernels per layer.

Measured on an H100 (benchmarks/profile_step.py, SmolLM2-135M, bfloat16, batch 1): a decode
step replayed ~17 kernels per decoder layer, at ~3 us each, so the step was bound by how many
kernels ran, not by the 0.09 ms it takes to read the weights. The rotation of queries and keys
was four kernels (two products, a roll, a sum) and the KV write two more; the gated MLP's
activation two. Here each is one kernel:
- `rotate_and_store`: rotates every query and key head of a token in place and writes its key
  and value into their cache slot;
- `silu_mul`: silu(gate) * up of the fused gate/up projection.
Both compute in float32 and round once (the torch path rounds after every op).

`ops_for(x)` hands them out where they apply: CUDA tensors with triton importable, unless
SPECSERVE_DISABLE_TRITON_OPS=1 (the torch path, for comparison). Under Triton's interpreter
(TRITON_INTERPRET=1) they run on CPU tensors too, which is how the tests check them here.

The slot mapping is not specialized on its alignment: a padded step's is a slice of the runner's
input buffer, a flat step's a fresh tensor, and each alignment class would be one more compile
(engine/attention/triton_backend.py says more). Kernels compile into specserve's cache folder.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from engine.core.cache_dir import use_triton_cache_dir
from engine.core.triton_jit import jit_options


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _available() -> bool:
    return os.environ.get("SPECSERVE_DISABLE_TRITON_OPS") != "1" and _triton_installed()


def ops_for(x: torch.Tensor):
    """This module where its kernels apply to tensors like `x`, else None."""
    on_device = x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if on_device and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _available():
        return TritonOps
    return None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    use_triton_cache_dir()

    @triton.jit(**jit_options(do_not_specialize_on_alignment=["slot_ptr"]))
    def rotate_and_store_kernel(
        qk_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
        stride_qk_token, stride_qk_head, stride_v_token, stride_v_head, stride_cos,
        stride_cache_slot, stride_cache_head,
        NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, QK_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0)
        heads = tl.arange(0, QK_HEADS)
        real = heads < NUM_HEADS + NUM_KV
        dims = tl.arange(0, HEAD_DIM)
        # rotate_half(x) * sin == x rolled by half a head * sin with its first half negated
        rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
        row = qk_ptr + token * stride_qk_token + heads[:, None] * stride_qk_head
        x = tl.load(row + dims[None, :], mask=real[:, None], other=0.0).to(tl.float32)
        x_rolled = tl.load(row + rolled[None, :], mask=real[:, None], other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_cos + dims).to(tl.float32)
        rotated = (x * cos[None, :] + x_rolled * sin[None, :]).to(qk_ptr.dtype.element_ty)
        tl.store(row + dims[None, :], rotated, mask=real[:, None])
        slot = tl.load(slot_ptr + token)
        is_key = real & (heads >= NUM_HEADS)
        key_head = tl.where(is_key, heads - NUM_HEADS, 0)
        tl.store(k_cache_ptr + slot * stride_cache_slot + key_head[:, None] * stride_cache_head
                 + dims[None, :], rotated, mask=is_key[:, None])
        kv_heads = tl.arange(0, KV_HEADS)
        kv_real = kv_heads < NUM_KV
        v = tl.load(v_ptr + token * stride_v_token + kv_heads[:, None] * stride_v_head
                    + dims[None, :], mask=kv_real[:, None], other=0.0)
        tl.store(v_cache_ptr + slot * stride_cache_slot + kv_heads[:, None] * stride_cache_head
                 + dims[None, :], v, mask=kv_real[:, None])

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out,
                        BLOCK: tl.constexpr):
        token = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < size
        gate = tl.load(gate_up_ptr + token * stride_in + columns, mask=inside,
                       other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + token * stride_in + size + columns, mask=inside,
                     other=0.0).to(tl.float32)
        activated = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + token * stride_out + columns,
                 activated.to(out_ptr.dtype.element_ty), mask=inside)

    return rotate_and_store_kernel, silu_mul_kernel


class TritonOps:
    @staticmethod
    def supports_rotation(qk: torch.Tensor, k_cache: torch.Tensor) -> bool:
        head_dim = qk.shape[-1]
        return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and qk.stride(-1) == 1
                and k_cache.is_contiguous())

    @staticmethod
    def rotate_and_store(qk: torch.Tensor,  # [T, heads + kv_heads, D], rotated in place
                         v: torch.Tensor,  # [T, kv_heads, D]
                         cos: torch.Tensor,  # [T, 1, D] at each token's position
                         sin_rolled: torch.Tensor,  # [T, 1, D]: sin, first half negated
                         num_heads: int,
                         k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, D]
                         v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:  # [T]
        num_tokens, qk_heads, head_dim = qk.shape
        if num_tokens == 0:
            return
        num_kv = qk_heads - num_heads
        rotate, _ = _kernels()
        rotate[(num_tokens,)](
            qk, v, cos, sin_rolled, slot_mapping, k_cache, v_cache,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=num_heads, NUM_KV=num_kv, QK_HEADS=_power_of_two(qk_heads),
            KV_HEADS=_power_of_two(num_kv), HEAD_DIM=head_dim)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        num_tokens, width = gate_up.shape
        size = width // 2
        out = gate_up.new_empty(num_tokens, size)
        if num_tokens == 0:
            return out
        block = min(1024, _power_of_two(size))
        _, silu_mul = _kernels()
        silu_mul[(num_tokens, -(-size // block))](gate_up, out, size, gate_up.stride(0),
                                                  out.stride(0), BLOCK=block)
        return out
