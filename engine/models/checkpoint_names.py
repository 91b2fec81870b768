"""Where a Hugging Face checkpoint tensor goes in our model: q/k/v and gate/up projections are
stored fused (one matrix each), so a checkpoint's `q_proj` is rows of `qkv_proj`. Pure functions
of the tensor name and the architecture; `LlamaForCausalLM.load_weights` does the copying."""

from __future__ import annotations

from engine.models.architecture import LlamaArchitecture

# (module, parameter, row offset, part tag): the part tag names which unfused projection filled
# rows of a fused one ("" for a tensor stored as it is).
Place = tuple[str, str, int, str]


def place_of(name: str, arch: LlamaArchitecture, tied_embeddings: bool) -> Place | None:
    """Where checkpoint tensor `name` goes; None for tensors this model does not store."""
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    if tied_embeddings:
        if name == "lm_head.weight":
            return None  # tied: the copy under embed_tokens is the same matrix
        if name == "embed_tokens.weight":
            name = "lm_head.weight"
    module_name, _, param_name = name.rpartition(".")
    module_name, out_offset, part = fused_place(module_name, arch)
    return module_name, param_name, out_offset, part


def fused_place(module_name: str, arch: LlamaArchitecture) -> tuple[str, int, str]:
    """Maps an unfused projection to (fused module, row offset, part tag)."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    places = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", arch.intermediate_size),
    }
    prefix, _, leaf = module_name.rpartition(".")
    parent_leaf = f"{prefix.rpartition('.')[2]}.{leaf}"
    if leaf in ("gate_proj", "up_proj") and prefix.rpartition(".")[0].endswith("mlp.experts"):
        # An expert of a mixture (Qwen3-MoE's mlp.experts.<e>): a gated MLP of its own size
        offset = 0 if leaf == "gate_proj" else arch.moe_intermediate_size
        return f"{prefix}.gate_up_proj", offset, f"#mlp.{leaf}"
    if parent_leaf in places:
        fused, offset = places[parent_leaf]
        layer_prefix = prefix.rpartition(".")[0]
        return f"{layer_prefix}.{fused}", offset, f"#{parent_leaf}"
    return module_name, 0, ""


def parts_of(param_name: str) -> list[str]:
    """The part tags that fill a parameter of ours completely."""
    if ".qkv_proj." in param_name:
        return ["#self_attn.q_proj", "#self_attn.k_proj", "#self_attn.v_proj"]
    if ".gate_up_proj." in param_name:
        return ["#mlp.gate_proj", "#mlp.up_proj"]
    return [""]
