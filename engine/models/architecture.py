"""The shape of a Llama-family decoder, read from a Hugging Face config.

One dataclass covers Llama 2/3, Mistral, Qwen2, Qwen3 (dense), Phi-3, Gemma 2, Gemma 3 and
SmolLM2: they differ only in biases, per-head query/key norms (Qwen3, Gemma 3), rotary scaling,
head counts, sliding windows on some or all layers, whether the LM head shares the embedding
matrix, and Gemma's differences (norms after attention and MLP as well as before, (1 + w) norm
weights, GELU, a scaled embedding, its own attention scale and soft-capped logits). Phi-3's
checkpoints store q/k/v and gate/up already fused, which the loader takes as they are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from engine.models import rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2",
                         "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class LlamaArchitecture:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear" | "yarn", ...}; None: plain RoPE
    # Qwen3: an RMSNorm over each head's query and key, before the rotation. Defaulted: EAGLE
    # heads saved before it existed describe their target without it.
    qk_norm: bool = False
    # Per layer: how many keys a query sees (sliding-window attention), None for all of them.
    # Empty: no layer has a window.
    layer_windows: tuple = ()
    # Gemma: the norms' stored weights are w, applied as (1 + w); the loader adds the offset.
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    hidden_act: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores soft-capped by tanh
    final_softcap: float | None = None  # Gemma 2: logits soft-capped by tanh
    # Gemma 3: sliding-window layers rotate with their own (theta, scaling); None: one rotation
    local_rope: tuple | None = None
    # Qwen3-MoE: the layers whose MLP is num_experts experts, of which each token uses the top
    # num_experts_per_tok (their probabilities renormalised over them where norm_topk_prob)
    sparse_layers: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self):  # read back from JSON (a saved EAGLE head's target): lists
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        if self.local_rope is not None:
            object.__setattr__(self, "local_rope", tuple(self.local_rope))

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def max_window(self) -> int | None:
        """The most keys any layer reads, None where some layer reads them all: blocks behind
        this window are never read again."""
        windows = [self.window_of(i) for i in range(self.num_layers)]
        return None if None in windows else max(windows)

    def local_rope_arch(self) -> "LlamaArchitecture":
        """This architecture with the sliding-window layers' rotation (Gemma 3)."""
        theta, scaling = self.local_rope
        return dataclasses.replace(self, rope_theta=theta, rope_scaling=scaling, local_rope=None)

    @classmethod
    def from_hf_config(cls, config) -> "LlamaArchitecture":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r}: specserve serves "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        rope_params = dict(getattr(config, "rope_parameters", None) or {})
        local_rope, legacy_scaling = None, getattr(config, "rope_scaling", None)
        if "full_attention" in rope_params:  # Gemma 3: a rotation per kind of layer
            local_rope = rope.rope_of(dict(rope_params.get("sliding_attention") or {}), None, config)
            # its rope_scaling is the same per-kind dict, already folded into full_attention
            rope_params, legacy_scaling = dict(rope_params["full_attention"]), None
        rope_theta, rope_scaling = rope.rope_of(rope_params, legacy_scaling, config)
        gemma = model_type in GEMMA_TYPES
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported: specserve serves "
                             "causal decoders")
        hidden_act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act",
                                                                           "silu")
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r} (supported: "
                             f"{', '.join(ACTIVATIONS)})")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            layer_windows=_layer_windows(config),
            norm_weight_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            hidden_act=hidden_act,
            embed_scale=config.hidden_size ** 0.5 if gemma else None,
            attention_scale=config.query_pre_attn_scalar ** -0.5 if gemma else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            local_rope=local_rope,
            **_experts(config),
        )

    def rope_inv_freq(self) -> torch.Tensor:  # [head_dim // 2] float32
        return rope.inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

    def rope_attention_factor(self) -> float:
        """What YaRN and LongRoPE multiply cos and sin by (so every attention logit by its
        square): it keeps attention's temperature as the context stretches. 1 for other ropes."""
        return rope.attention_factor(self.rope_scaling)


def _experts(config) -> dict:
    """Qwen3-MoE's expert fields: a layer has experts unless listed in mlp_only_layers, every
    decoder_sparse_step-th layer (transformers' rule). Empty for dense models."""
    # (config.json spells it num_local_experts; transformers' config class maps the name)
    num_experts = getattr(config, "num_experts", None) or \
        getattr(config, "num_local_experts", None) or 0
    if not num_experts:
        return {}
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    sparse = tuple(i for i in range(config.num_hidden_layers)
                   if i not in dense and (i + 1) % step == 0)
    return dict(sparse_layers=sparse, num_experts=num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))


def _layer_windows(config) -> tuple:
    """Each layer's sliding window, or () where none has one. Models that name their layers'
    kinds (Gemma, Qwen2/3) window the "sliding_attention" ones; Mistral and Phi-3 all of them."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return ()
    kinds = getattr(config, "layer_types", None) or \
        ["sliding_attention"] * config.num_hidden_layers
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported attention layer types {sorted(unknown)} (supported: "
                         "sliding_attention, full_attention)")
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(windows) else ()
