"""The shape of a Llama-family decoder, read from a Hugging Face config.

One dataclass covers Llama 2/3, Mistral, Qwen2, Qwen3 (dense), Phi-3 and SmolLM2: they differ
only in biases, per-head query/key norms (Qwen3), rotary scaling, head counts and whether the LM
head shares the embedding matrix (Phi-3's checkpoints store q/k/v and gate/up already fused,
which the loader takes as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


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
        legacy_scaling = getattr(config, "rope_scaling", None)
        if legacy_scaling:
            rope_params.update(legacy_scaling)
        rope_theta = rope_params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
        rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
        if rope_type not in ("default", "llama3", "linear", "yarn"):
            raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: llama3, linear, "
                             "yarn)")
        if rope_type == "yarn":  # the pretrained context, where it is not written down
            rope_params.setdefault("original_max_position_embeddings",
                                   config.max_position_embeddings)
        if model_type == "qwen3" and getattr(config, "use_sliding_window", False):
            raise ValueError("qwen3 with use_sliding_window is not supported: no sliding-window "
                             "attention here yet")
        partial_rotary = rope_params.pop("partial_rotary_factor", None) or getattr(
            config, "partial_rotary_factor", 1.0)
        if partial_rotary != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial_rotary}) "
                             "are not supported")
        max_positions = config.max_position_embeddings
        sliding_window = getattr(config, "sliding_window", None)
        if model_type in ("mistral", "phi3") and sliding_window:
            # No sliding-window attention here: stay inside the window, where it is exact.
            max_positions = min(max_positions, sliding_window)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else {**rope_params, "rope_type": rope_type},
        )

    def rope_inv_freq(self) -> torch.Tensor:  # [head_dim // 2] float32
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        if scaling["rope_type"] == "linear":
            return inv_freq / scaling["factor"]
        if scaling["rope_type"] == "yarn":
            return _yarn_inv_freq(inv_freq, scaling, self.head_dim, self.rope_theta)
        return _llama3_inv_freq(inv_freq, scaling)

    def rope_attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (so every attention logit by its square): it
        keeps attention's temperature as the context stretches. 1 for other ropes."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = scaling["factor"]
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form: a ratio of two such terms
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)


def _yarn_mscale(factor: float, weight: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, head_dim: int,
                   theta: float) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): dimensions that turn many times within the pretrained context keep
    their frequency, those that turn less than once are interpolated by `factor`, and a linear
    ramp over the dimensions between blends the two."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_turning(times: float) -> float:  # the dimension with `times` turns
        return head_dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(fast), dimension_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are stretched by `factor`, short ones kept,
    and the band between is interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_max = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
