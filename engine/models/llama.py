"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3 dense, Phi-3, SmolLM2) on a paged KV
cache.

Projections are fused (q/k/v into one matrix, gate/up into another) so a layer runs four matmuls
where transformers runs seven. `forward` can run any subset of the layers and still apply the final
norm and LM head: the layer-skip proposer drafts with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import triton_backend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import paged_attention
from engine.models.architecture import LlamaArchitecture
from engine.models.checkpoint_names import Place, parts_of, place_of
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding, RotaryStep
from engine.quant.gguf_weight import PackedTensor
from engine.quant.kernels import cpu_ops_for, load_kernel

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
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
        self.backend = "torch"  # of decode/verify attention (engine/attention/)

    def forward(self, x, rope: RotaryStep, k_cache, v_cache, meta: AttentionMetadata):
        qk, v = self.qkv_proj(x).split([self.split_sizes[0] + self.split_sizes[1],
                                        self.split_sizes[2]], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # each head's query and key normalised before the rotation
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])], dim=1)
        # Queries and keys sit side by side in the projection: one rotation covers both.
        qk = rope.rotate(qk, self.num_heads)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.backend)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        fused = cpu_ops_for(gate_up)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, rope: RotaryStep, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_weights(self) -> tuple | None:
        """This layer's weights as the fused CPU layer (cpu_ops.cpp `decoder_layer`) takes them,
        or None where it does not apply: a projection not in one GGUF block format, or MLP
        biases. Fixed once the weights are loaded."""
        if not hasattr(self, "_fused_weights"):
            attn, mlp = self.self_attn, self.mlp
            projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            single = all(p.gguf is not None and len(p.gguf.parts) == 1 for p in projections)
            self._fused_weights = None
            if single and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None \
                    and not attn.qk_norm:  # the fused layer has no per-head norms
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


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        self.arch = arch
        # A tied model has one vocabulary matrix: the LM head's, which doubles as the embedding.
        self.embed_tokens = (
            None if arch.tie_word_embeddings else nn.Embedding(arch.vocab_size, arch.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size)
        # Tables computed on CPU even under a meta-device context: torch's meta implementation of
        # arange imports sympy (~40 MB of resident memory) for nothing.
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(arch)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.embed_tokens is None:
            return self.lm_head.embedding(input_ids)
        return self.embed_tokens(input_ids)

    def set_attention_backend(self, name: str) -> None:
        """Raises ValueError where the backend cannot run (the triton package missing)."""
        if name == "triton":
            triton_backend.check_available()
        for layer in self.layers:
            layer.self_attn.backend = name

    def pack_for_cpu(self) -> None:
        """Repacks every projection for the CPU's fastest kernel (no-op elsewhere)."""
        for module in self.modules():
            if isinstance(module, Linear):
                tied_head = module is self.lm_head and self.embed_tokens is None
                module.pack_for_cpu(keep_plain_weight=tied_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] rows of the batch whose logits are needed
        layer_ids: Sequence[int] | None = None,  # None: all layers
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, layer_ids)
        return self.logits(hidden, logits_indices)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab] float32: final norm and LM head at the given rows only."""
        return self.lm_head(self.norm(hidden[rows])).float()

    @torch.inference_mode()
    def hidden_states(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                      layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """[num_tokens, hidden] after the decoder layers (before the final norm); writes KV."""
        x = self.embed(input_ids)
        stack = self._decoder_stack(cpu_ops_for(x), kv_caches) \
            if not meta.chunks and meta.batched is not None else None
        if stack is not None:
            group = meta.batched
            stack.run(x, positions.contiguous(), kv_caches.storage, meta.slot_mapping,
                      group.token_index, group.query_lens, group.context_lens,
                      group.block_tables, [] if layer_ids is None else list(layer_ids))
            return x
        rope = self.rotary.at(positions, x.dtype)
        for i in range(self.arch.num_layers) if layer_ids is None else layer_ids:
            k_cache, v_cache = kv_caches[i]
            x = self.layers[i](x, rope, k_cache, v_cache, meta)
        return x

    def _decoder_stack(self, fused, kv_caches):
        """The compiled decoder stack (csrc/decoder_stack.cpp) holding every layer's weights, or
        None where it does not apply: not the CPU float32 path, a layer without fused weights,
        or a cache that is not one KVCache storage. Built on first use."""
        if fused is None or getattr(kv_caches, "storage", None) is None:
            return None
        stack = getattr(self, "_stack", None)
        if stack is None or stack[1] is not self.rotary.cos:  # tables rebuilt: rebind them
            weights = [layer.fused_weights() for layer in self.layers]
            a = self.arch
            built = None if any(w is None for w in weights) else fused.DecoderStack(
                [w[:2] + w[3:] for w in weights], weights[0][2], self.rotary.cos,
                self.rotary.sin, a.num_heads, a.num_kv_heads, a.head_dim)
            stack = self._stack = (built, self.rotary.cos)
        return stack[0]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into this model, fusing q/k/v and gate/up.

        Raises ValueError naming a tensor that has no place here, or parameters left unfilled.
        """
        modules = dict(self.named_modules())
        filled: set[str] = set()
        for name, tensor in named_tensors:
            place = self._place(name)
            if place is None:
                continue
            module_name, param_name, out_offset, part = place
            module = modules.get(module_name)
            if module is None or not hasattr(module, param_name):
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            if isinstance(module, Linear):
                module.load(param_name, tensor, out_offset)
            else:
                if isinstance(tensor, PackedTensor):  # e.g. an untied embedding in GGUF blocks
                    tensor = tensor.dequantize()
                with torch.no_grad():
                    getattr(module, param_name).copy_(tensor)
            # A checkpoint that stores a fused projection whole (Phi-3's qkv_proj and
            # gate_up_proj) fills every part of it at once.
            parts = [part] if part else parts_of(f"{module_name}.{param_name}")
            filled.update(f"{module_name}.{param_name}{p}" for p in parts)
        expected = {f"{n}{part}" for n, _ in self.named_parameters() for part in parts_of(n)}
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        unfilled = [n for n, m in modules.items()
                    if isinstance(m, Linear) and m.gguf is not None and not m.gguf.complete]
        if unfilled:
            raise ValueError(f"GGUF weights do not cover every row of {unfilled[:3]}")

    def keep_in_blocks(self, weight_names: Iterable[str]) -> None:
        """Marks the projections these checkpoint weights go to as GGUF-packed (call on the meta
        device, before storage is allocated)."""
        modules = dict(self.named_modules())
        for name in weight_names:
            place = self._place(name)
            if place is not None and place[1] == "weight":
                module = modules.get(place[0])
                if isinstance(module, Linear) and module.gguf is None:
                    module.keep_in_blocks()

    def use_integer_kernels(self) -> None:
        """GGUF projections move to int8 activations and integer dot products where their format
        allows (engine/quant/int8.py): llama.cpp's arithmetic, --quantization gguf. Raises
        ValueError where SPECSERVE_INT8_ISA names a variant this CPU lacks."""
        kernel = load_kernel()
        if kernel is not None:
            try:
                variant = kernel.int8_isa()
            except RuntimeError as error:
                raise ValueError(str(error).splitlines()[0]) from None
            logger.info("integer GGUF kernels: %s", variant)
        for module in self.modules():
            if isinstance(module, Linear) and module.gguf is not None:
                module.gguf.use_integer_kernels()

    def gguf_format_names(self) -> list[str]:
        return sorted({f for m in self.modules() if isinstance(m, Linear) and m.gguf
                       for f in m.gguf.format_names})

    def gguf_bytes(self) -> int:
        return sum(m.gguf.nbytes for m in self.modules() if isinstance(m, Linear) and m.gguf)

    def _place(self, name: str) -> Place | None:
        return place_of(name, self.arch, tied_embeddings=self.embed_tokens is None)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()
