"""A Llama decoder layer in five kernels for the decode and verify steps of a GPU (issue 71):

    RMSNorm + QKV + RoPE + KV store -> attention -> O + residual
    -> RMSNorm + gate/up + SiLU -> down + residual

where the torch path runs nine (norm, QKV, rotate-and-store, attention, O + residual, norm,
gate/up, SiLU-and-multiply, down + residual). The products are skinny_gemm.py's row-invariant
kernels; attention is the layer's own backend call, unchanged.

Where: `--fused-kernels auto` (the default) on CUDA, bfloat16 or float16, for layers that are
plain Llama (no per-head q/k norms, Gemma norms, GELU, experts, biases, GGUF blocks) and steps
of 1 to MAX_ROWS rows; prefill chunks wider than that stay on the torch path, which remains the
reference and the fallback. `--fused-kernels off` keeps every step on the torch path. The CPU
path never takes this one. Under --batch-invariant the fused kernels stay on, as they are
row-invariant themselves.
"""

from __future__ import annotations

import os

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import paged_attention
from engine.models import skinny_gemm
from engine.models.skinny_tiles import MAX_ROWS

FUSED_KERNEL_MODES = ("auto", "off")
DTYPES = (torch.bfloat16, torch.float16)


def device_allows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `--fused-kernels auto` turns the path on for a model on `device` in `dtype`."""
    return device.type == "cuda" and dtype in DTYPES


def layer_allows(layer) -> bool:
    """Whether a DecoderLayer is one the fused kernels compute: a plain Llama layer whose four
    projections are dense weights without biases, and whose heads the RoPE epilogue can split
    (a power-of-two head size of at least 32, so half a head holds a 16-column tile). The
    classes must be exactly MLP and Linear: a subclass adds work of its own to forward (a
    tensor-parallel shard's all-reduce, engine/distributed/parallel_layers.py) that the fused
    kernels would skip."""
    from engine.models.layers import MLP, Linear

    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not MLP or mlp.gelu or attn.qk_norm or layer.sandwich \
            or layer.local_rope:
        return False
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    dense = all(type(p) is Linear and p.gguf is None and p.packed_weight is None and p.bias is None
                and p.weight.dim() == 2 and p.weight.is_contiguous() for p in projections)
    head_dim = attn.head_dim
    return dense and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def step_allows(x: torch.Tensor, rope, k_cache: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this step's tensors suit the kernels: 1 to MAX_ROWS rows in the weights' dtype,
    the rotation tables gathered per row (the GPU's RotaryStep), a contiguous cache. The
    condition on rows is the row count alone, so a row takes the same path whatever shares it."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and rope.fused is None and rope.cos.dim() == 3 and k_cache.is_contiguous()
            and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def forward(layer, x: torch.Tensor,  # [rows, hidden]
            rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:  # [rows, hidden]
    """The layer's output for a step that `step_allows`; writes the step's KV."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = skinny_gemm.norm_qkv_rope(
        x, layer.input_layernorm.weight, layer.input_layernorm.eps, attn.qkv_proj.weight,
        rope.cos, rope.sin, attn.num_heads, k_cache, v_cache, meta.slot_mapping)
    heads = qkv.view(-1, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    q = heads[:, :attn.num_heads]
    k = heads[:, attn.num_heads:attn.num_heads + attn.num_kv_heads]
    v = heads[:, attn.num_heads + attn.num_kv_heads:]
    # Keys and values are in the cache already; prefill chunks in the step read them from here.
    attended = paged_attention(q, k, v, k_cache, v_cache, meta, attn.backend, attn.options,
                               kv_written=True)
    x = skinny_gemm.linear(attended.flatten(1), attn.o_proj.weight, residual=x)
    activated = skinny_gemm.norm_gate_up_silu(
        x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
        mlp.gate_up_proj.weight)
    return skinny_gemm.linear(activated, mlp.down_proj.weight, residual=x)
