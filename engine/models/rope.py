"""Rotary position embeddings: the inverse frequencies and attention factor of each rope type a
config may name (plain, `linear`, `llama3`, `yarn`, `longrope`), written from the papers'
definitions; `rope_of` reads them from a config."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


def rope_of(rope_params: dict, legacy_scaling: dict | None, config) -> tuple[float, dict | None]:
    """(theta, scaling) of one rotation from a config's rope parameters; scaling None for plain
    RoPE. Raises ValueError for a kind of scaling not implemented here."""
    if legacy_scaling:
        rope_params.update(legacy_scaling)
    rope_theta = rope_params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: "
                         f"{', '.join(ROPE_TYPES[1:])})")
    if rope_type in ("yarn", "longrope"):  # the pretrained context, where it is not written down
        rope_params.setdefault("original_max_position_embeddings", getattr(
            config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    if rope_type == "longrope":
        _choose_longrope_factors(rope_params, config)
    partial_rotary = rope_params.pop("partial_rotary_factor", None) or getattr(
        config, "partial_rotary_factor", 1.0)
    if partial_rotary != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial_rotary}) "
                         "are not supported")
    scaling = None if rope_type == "default" else {**rope_params, "rope_type": rope_type}
    return float(rope_theta), scaling


def _choose_longrope_factors(rope_params: dict, config) -> None:
    """LongRoPE's per-pair factors: the long ones where the served context (max_position_embeddings,
    cut to --max-model-len at load) exceeds the pretrained one, else the short ones; for every
    request and position alike, as vLLM chooses. Transformers picks per forward call by its
    longest position, so that prefix-cached, chunked or batched KV would mix the two; one choice
    per server keeps every position's rotation the same however it is computed."""
    original = rope_params["original_max_position_embeddings"]
    if rope_params.get("factor") is None:  # the attention factor's, from the trained context
        rope_params["factor"] = config.max_position_embeddings / original
    long = config.max_position_embeddings > original
    factors = list(rope_params["long_factor" if long else "short_factor"])
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    if len(factors) != head_dim // 2:
        raise ValueError(f"LongRoPE lists {len(factors)} factors for heads of {head_dim} "
                         f"dimensions (expected {head_dim // 2})")
    rope_params["factors"] = factors



def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32: the rotation speed of each pair of dimensions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        # one factor per pair, short or long as chosen at load (rope_of)
        return 1.0 / (torch.tensor(scaling["factors"], dtype=torch.float32) * theta ** exponents)
    plain = 1.0 / (theta ** exponents)
    if scaling is None:
        return plain
    if scaling["rope_type"] == "linear":
        return plain / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(plain, scaling, head_dim, theta)
    return _llama3_inv_freq(plain, scaling)


def attention_factor(scaling: dict | None) -> float:
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling["rope_type"] == "longrope":  # the LongRoPE paper's
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
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
