"""Writes a tiny transformers model as llama.cpp's converter would (its tensor names, its keys,
llama's query/key rows permuted, Gemma's norms stored as 1 + w, a mixture's experts stacked one
tensor a layer), with the default model's tokenizer copied from its GGUF file: the GGUF files of
the families, made by the tests."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA = ("gemma2", "gemma3")


def gguf_name(hf_name: str, architecture: str) -> str | None:
    """llama.cpp's name for a Hugging Face tensor; None for an expert's (stacked apart)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    layer, module, param = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", hf_name).groups()
    if module.endswith("mlp.experts"):
        return None
    names = {**_LAYER_NAMES, **(_GEMMA_NAMES if architecture in GEMMA else {})}
    return f"blk.{layer}.{names[module]}.{param}"


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's order of a llama query/key projection's rows: each head's rotary pairs
    interleaved rather than in two halves."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def _keys(config, architecture: str) -> dict:
    """(GGUF key -> (value, writer method)) as llama.cpp's converter writes them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys = {"block_count": config.num_hidden_layers,
            "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "vocab_size": config.vocab_size}
    floats = {"attention.layer_norm_rms_epsilon": config.rms_norm_eps}
    rope = config.rope_parameters
    floats["rope.freq_base"] = (rope.get("full_attention") or rope)["rope_theta"]
    if architecture == "qwen3moe":
        keys.update(expert_count=config.num_experts, expert_used_count=config.num_experts_per_tok,
                    expert_feed_forward_length=config.moe_intermediate_size)
    if architecture in GEMMA:
        keys["attention.sliding_window"] = config.sliding_window
    if architecture == "gemma2":
        floats.update(attn_logit_softcapping=config.attn_logit_softcapping,
                      final_logit_softcapping=config.final_logit_softcapping)
    if architecture == "phi3" and rope.get("rope_type") == "longrope":
        keys["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
        if getattr(config, "sliding_window", None):
            keys["attention.sliding_window"] = config.sliding_window
    return {**{k: (v, "add_uint32") for k, v in keys.items()},
            **{k: (v, "add_float32") for k, v in floats.items()}}


def write_gguf(hf_model, path: Path, architecture: str, tokenizer_gguf: Path,
               quantize=None) -> dict[str, np.ndarray]:
    """Writes `hf_model` to `path`; matrices in `quantize` (a gguf.GGMLQuantizationType) where
    given, the rest float32. Returns the weights as the file holds them, dequantized and under
    transformers' names, so a reference can run on exactly those."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, (value, method) in _keys(hf_model.config, architecture).items():
        getattr(writer, method)(f"{architecture}.{key}", value)
    source = gguf.GGUFReader(str(tokenizer_gguf))
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    held: dict[str, np.ndarray] = {}
    experts: dict[str, list[tuple[str, np.ndarray]]] = {}

    def add(name: str, data: np.ndarray) -> np.ndarray:
        if quantize is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            packed = gguf.quants.quantize(data, quantize)
            writer.add_tensor(name, packed, raw_dtype=quantize)
            return gguf.quants.dequantize(packed, quantize).reshape(data.shape)
        writer.add_tensor(name, data)
        return data

    for hf_name, data in state.items():
        name = gguf_name(hf_name, architecture)
        if name is None:  # model.layers.L.mlp.experts.{gate_up,down}_proj: [experts, rows, cols]
            layer, proj = re.search(r"layers\.(\d+)\.mlp\.experts\.(\w+)_proj", hf_name).groups()
            parts = dict(zip(["gate", "up"], np.split(data, 2, axis=1))) \
                if proj == "gate_up" else {proj: data}
            for part, stack in parts.items():
                experts[f"blk.{layer}.ffn_{part}_exps.weight"] = [
                    (f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight", matrix)
                    for e, matrix in enumerate(stack)]
            continue
        stored = data + 1 if architecture in GEMMA and hf_name.endswith("norm.weight") else data
        if architecture == "llama" and re.search(r"\.(q|k)_proj\.weight$", hf_name):
            stored = _permute(stored, hf_model.config.num_attention_heads if ".q_proj." in hf_name
                              else hf_model.config.num_key_value_heads)
            held[hf_name] = data if quantize is None else None  # (not dequantized back here)
            add(name, stored)
            continue
        held[hf_name] = add(name, stored) - (stored - data)
    rope = hf_model.config.rope_parameters
    if architecture == "phi3" and rope.get("rope_type") == "longrope":  # factors as tensors
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))
    for name, members in experts.items():
        stored = add(name, np.stack([data for _, data in members]))
        held.update((hf_name, matrix) for (hf_name, _), matrix in zip(members, stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
