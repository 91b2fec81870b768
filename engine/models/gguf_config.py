"""What transformers' GGUF config reader leaves out, read from the file's own keys as llama.cpp
reads them: a head size apart from hidden / heads (Qwen3), a mixture's expert size and its
renormalised routing (Qwen3-MoE), Gemma's soft-caps, query scale and rope scaling, Phi-3's
LongRoPE (its factors are tensors of the file) and sliding window. Applied to the config before
the metadata folder is written (gguf_native.metadata_folder)."""

from __future__ import annotations


def complete_config(config, fields: dict, rope_factors: dict) -> None:
    """Sets on `config` (a transformers config read from the file) what the GGUF keys `fields`
    (name -> value) and its `rope_factors` tensors (name -> list) say and transformers' reader
    does not."""
    arch = fields["general.architecture"]

    def key(name: str, default=None):
        return fields.get(f"{arch}.{name}", default)

    head_dim = key("attention.key_length")
    if head_dim:
        config.head_dim = int(head_dim)
    if arch == "qwen3moe":
        config.moe_intermediate_size = int(key("expert_feed_forward_length"))
        config.norm_topk_prob = True  # llama.cpp renormalises Qwen3-MoE's top-k weights
    if arch in ("gemma2", "gemma3"):
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        # llama.cpp's rule: the 27B models scale queries by hidden / heads, the others by the
        # head size (their query_pre_attn_scalar); the files do not say
        is_27b = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads \
            if is_27b else head_dim
    if arch == "gemma2":
        config.attn_logit_softcapping = key("attn_logit_softcapping")
        config.final_logit_softcapping = key("final_logit_softcapping")
    if arch == "phi3":
        _phi3_rope_and_window(config, key, rope_factors)
    if arch == "gemma3" and key("rope.scaling.type") == "linear":
        config.rope_parameters["full_attention"].update(
            rope_type="linear", factor=float(key("rope.scaling.factor")))


def _phi3_rope_and_window(config, key, rope_factors: dict) -> None:
    if key("attention.sliding_window"):
        config.sliding_window = int(key("attention.sliding_window"))
    long = rope_factors.get("rope_factors_long.weight")
    if long is None:
        return
    original = int(key("rope.scaling.original_context_length"))
    config.original_max_position_embeddings = original
    config.rope_parameters = {
        "rope_type": "longrope", "rope_theta": float(key("rope.freq_base", 10000.0)),
        "long_factor": long, "short_factor": rope_factors["rope_factors_short.weight"],
        "original_max_position_embeddings": original}
    if key("rope.scaling.attn_factor") is not None:
        config.rope_parameters["attention_factor"] = float(key("rope.scaling.attn_factor"))
