"""A draft head's decoder layer over dense [batch, time] sequences in plain torch, for training:
the same attention and MLP the paged inference path runs (engine/models/decoder_layer.py), with
autograd. Both heads' `train_forward` (eagle_head.py, heads_published/eagle3.py) use it; tests hold
each equal to its paged path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.architecture import LlamaArchitecture
from engine.models.layers import rotate_half


def causal_attention(x: torch.Tensor,  # [B, T, in]
                     attn, arch: LlamaArchitecture, rotary,
                     positions: torch.Tensor) -> torch.Tensor:  # [B, T, heads x head_dim]
    """`attn`'s q/k/v projection of x, rotated at `positions`, attending causally within each
    sequence (grouped KV heads repeated); the output before the O projection."""
    batch, time, _ = x.shape
    q, k, v = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).split(attn.split_sizes,
                                                                          dim=-1)
    q = q.view(batch, time, arch.num_heads, arch.head_dim)
    k = k.view(batch, time, arch.num_kv_heads, arch.head_dim)
    v = v.view(batch, time, arch.num_kv_heads, arch.head_dim)
    cos = rotary.cos[positions].to(x.dtype)[:, None, :]  # [T, 1, D]
    sin = rotary.sin[positions].to(x.dtype)[:, None, :]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    groups = arch.num_heads // arch.num_kv_heads
    attended = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(groups, dim=2).transpose(1, 2),
        v.repeat_interleave(groups, dim=2).transpose(1, 2), is_causal=True,
        scale=arch.attention_scale)
    return attended.transpose(1, 2).reshape(batch, time, -1)


def gated_mlp(h: torch.Tensor, mlp, intermediate_size: int) -> torch.Tensor:
    """down(silu(gate) * up) of the already normalized h, with the MLP's biases where it has any."""
    gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).split(
        intermediate_size, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
