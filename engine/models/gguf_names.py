"""Where a tensor of a llama.cpp GGUF file goes, in Hugging Face checkpoint names, per
architecture: the names llama.cpp's converter writes (`blk.<layer>.<kind>`), the kinds whose
meaning differs by family (Gemma's four norms, Phi-3's fused gate/up), and the expert tensors of a
mixture (Qwen3-MoE), one per layer holding every expert."""

from __future__ import annotations

import re

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # stored fused (Phi-3)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
}
_GEMMA_TENSORS = {  # four norms a layer; llama.cpp's ffn_norm is the one before the MLP
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCHITECTURE_TENSORS = {
    "gemma2": _GEMMA_TENSORS,
    "gemma3": _GEMMA_TENSORS,
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, as Phi-3's checkpoints store
}
# A mixture's experts: one tensor a layer, [experts, rows, columns]
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                   "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Computed from the config, or read into it (Phi-3's LongRoPE factors: gguf_config.py)
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp's converter stores these families' norm weights as 1 + w (Gemma applies 1 + w)
NORMS_PLUS_ONE = ("gemma2", "gemma3")


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, None for tensors the model computes itself. An
    expert tensor's name has `{expert}` where each expert's index goes. Raises ValueError for a
    tensor with no place in the family."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    kind = match.group(2) if match else None
    if kind in _EXPERT_TENSORS:
        return f"model.layers.{match.group(1)}.mlp.experts.{{expert}}.{_EXPERT_TENSORS[kind]}." \
               f"{match.group(3)}"
    kinds = {**_LAYER_TENSORS, **_ARCHITECTURE_TENSORS.get(architecture, {})}
    if kind not in kinds:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")
    layer, _, param = match.groups()
    return f"model.layers.{layer}.{kinds[kind]}.{param}"
