"""One decoder layer of the Llama family and its parts, with each family's differences as options:
per-head q/k norms (Qwen3, Gemma 3), a sliding window, Gemma's attention scale and soft-capped
scores (AttentionOptions), GELU in the gated MLP, Gemma's norms after attention and MLP, and
experts in place of the MLP (Qwen3-MoE, moe.py).

Projections are fused (q/k/v into one matrix, gate/up into another) so a layer runs four matmuls
where transformers runs seven.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.options import AttentionOptions
from engine.attention.torch_backend import paged_attention
from engine.models import fused_layer
from engine.models.architecture import LlamaArchitecture
from engine.models.layers import MLP, Linear, RMSNorm, RotaryStep
from engine.models.moe import SparseMoE
from engine.models.triton_ops import ops_for as triton_ops_for


class Attention(nn.Module):
    def __init__(self, arch: LlamaArchitecture, layer: int = 0):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.options = AttentionOptions(window=arch.window_of(layer), scale=arch.attention_scale,
                                        softcap=arch.attn_softcap)
        self.backend = "torch"  # of decode/verify attention (engine/attention/)

    def forward(self, x, rope: RotaryStep, k_cache, v_cache, meta: AttentionMetadata,
                residual: torch.Tensor | None = None):
        """The attention's output, plus `residual` where given (added in the projection's
        epilogue on GPUs)."""
        qk, v = self.qkv_proj(x).split([self.split_sizes[0] + self.split_sizes[1],
                                        self.split_sizes[2]], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # each head's query and key normalised before the rotation
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Queries and keys sit side by side in the projection: one rotation covers both.
        fused = triton_ops_for(qk) if rope.fused is None else None
        kv_written = fused is not None and fused.supports_rotation(qk, k_cache)
        if kv_written:  # one kernel rotates and stores this step's keys and values
            fused.rotate_and_store(qk, v, rope.cos, rope.sin, self.num_heads, k_cache, v_cache,
                                   meta.slot_mapping)
        else:
            qk = rope.rotate(qk, self.num_heads)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.backend, self.options,
                              kv_written)
        return self.o_proj(out.flatten(1), residual)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchitecture, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer)
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with two
        # more around the MLP (transformers' names, so checkpoints load by name).
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SparseMoE(arch) if arch.is_sparse(layer) else MLP(arch)
        # Gemma 3: sliding-window layers rotate with a rotation of their own
        self.local_rope = arch.local_rope is not None and arch.window_of(layer) is not None
        # --fused-kernels: decode and verify steps in five kernels (fused_layer.py); set once
        # the weights are loaded, where fused_layer.layer_allows this layer.
        self.fused = False

    def forward(self, x, rope: RotaryStep, k_cache, v_cache, meta):
        if self.fused and fused_layer.step_allows(x, rope, k_cache, self.self_attn.qkv_proj.weight):
            return fused_layer.forward(self, x, rope, k_cache, v_cache, meta)
        if self.sandwich:
            attended = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        # The residual adds ride on the output projections (Linear: one GEMM on GPUs).
        x = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta, residual=x)
        if isinstance(self.mlp, MLP):
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_weights(self) -> tuple | None:
        """This layer's weights as the fused CPU layer (cpu_ops.cpp `decoder_layer`) takes them,
        or None where it does not apply: a projection not in one GGUF block format, MLP biases,
        or a layer that is not Llama's (per-head norms, Gemma's norms, scale, soft-cap, GELU,
        experts).
        Fixed once the weights are loaded."""
        if not hasattr(self, "_fused_weights"):
            attn, mlp = self.self_attn, self.mlp
            if not isinstance(mlp, MLP):
                self._fused_weights = None
                return None
            projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            single = all(p.gguf is not None and len(p.gguf.parts) == 1 for p in projections)
            llama_layer = not (attn.qk_norm or self.sandwich or mlp.gelu or self.local_rope
                               or attn.options.scale is not None
                               or attn.options.softcap is not None)
            self._fused_weights = None
            if single and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None \
                    and llama_layer:
                (qkv,), (o,), (gate_up,), (down,) = (p.gguf.parts for p in projections)
                self._fused_weights = (
                    self.input_layernorm.weight.detach(),
                    self.post_attention_layernorm.weight.detach(),
                    self.input_layernorm.eps,
                    qkv.packed, qkv.fmt.ggml_type, _detached(attn.qkv_proj.bias),
                    o.packed, o.fmt.ggml_type, _detached(attn.o_proj.bias),
                    gate_up.packed, gate_up.fmt.ggml_type, down.packed, down.fmt.ggml_type,
                )
        return self._fused_weights


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()
