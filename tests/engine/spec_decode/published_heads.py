"""Writes EAGLE-3 heads as the published formats lay them out (names, dtypes, config keys) and
computes their drafts densely from those definitions: the reference the served head is held to.

Layouts (from the formats' own definitions):
- "eagle3": EAGLE / SpecForge, `architectures: ["LlamaForCausalLMEagle3"]`, `midlayer.*`,
  `eagle_config.eagle_aux_hidden_state_layer_ids`, bfloat16 weights, int64 `d2t`, bool `t2d`;
- "speculators": `speculators_model_type: "eagle3"`, the layer's Llama config under
  `transformer_layer_config`, `layers.0.*`, `embed_tokens.weight` included.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.spec_decode.heads_published.eagle3_writer import draft_maps


def write_head(folder: Path, target_config, token_ids: list[int], layer_ids: list[int], *,
               layout: str = "eagle3", hidden_size: int | None = None, std: float = 0.3,
               seed: int = 0, with_lm_head: bool = True, with_embed: bool = False,
               weights_file: str = "model.safetensors", dtype=torch.bfloat16,
               drop: tuple[str, ...] = (), config_overrides: dict | None = None) -> Path:
    """Saves a random EAGLE-3 head for the target whose transformers config is `target_config`;
    its draft vocabulary is `token_ids` (in draft-id order). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target_hidden = target_config.hidden_size
    hidden = hidden_size or target_hidden
    heads, kv_heads = target_config.num_attention_heads, target_config.num_key_value_heads
    head_dim = hidden // heads
    inter = 2 * hidden
    vocab = target_config.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * std

    def norm(size):
        return 1 + 0.1 * torch.randn(size, generator=generator)

    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    tensors = {
        "fc.weight": rand(hidden, len(layer_ids) * target_hidden), "norm.weight": norm(hidden),
        prefix + "input_layernorm.weight": norm(hidden),
        prefix + "hidden_norm.weight": norm(hidden),
        prefix + "post_attention_layernorm.weight": norm(hidden),
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, inter),
    }
    if with_lm_head:
        tensors["lm_head.weight"] = rand(len(token_ids), hidden)
    if with_embed or layout == "speculators":
        tensors["embed_tokens.weight"] = rand(vocab, hidden) / std
    tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    tensors.update(draft_maps(torch.tensor(token_ids), vocab))  # target = draft + d2t[draft]
    for name in drop:
        tensors.pop(name)
    layer = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
        "rms_norm_eps": target_config.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": target_config.max_position_embeddings,
        "rope_theta": getattr(target_config, "rope_theta", None) or 10000.0,
        "vocab_size": vocab, "tie_word_embeddings": False,
    }
    if layout == "eagle3":
        config = dict(layer, architectures=["LlamaForCausalLMEagle3"], torch_dtype="bfloat16",
                      draft_vocab_size=len(token_ids),
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                                    "use_aux_hidden_state": True})
        if hidden != target_hidden:
            config["target_hidden_size"] = target_hidden
    else:
        config = {
            "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "speculators_version": "0.2.0", "transformer_layer_config": layer,
            "draft_vocab_size": len(token_ids), "norm_before_residual": False,
            "target_hidden_size": target_hidden if hidden != target_hidden else None,
            "eagle_aux_hidden_state_layer_ids": list(layer_ids),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
            },
        }
    config.update(config_overrides or {})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if weights_file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(folder / weights_file))
    else:
        torch.save(tensors, folder / weights_file)
    return folder


def read_head(folder: Path) -> tuple[dict, dict]:
    """(config, float32 tensors under `midlayer.` names) of a head `write_head` saved."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    path = folder / "model.safetensors"
    raw = load_file(str(path)) if path.is_file() else torch.load(folder / "pytorch_model.bin")
    tensors = {name.replace("layers.0.", "midlayer."): t for name, t in raw.items()}
    return config, {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}


def reference_forward(config: dict, tensors: dict, aux: torch.Tensor, next_embeds: torch.Tensor,
                      ) -> torch.Tensor:
    """[T, H] the head's pre-norm output at every position of one sequence, dense and causal:
    `aux` [T, k H_target] the raw residual streams at the feature layers, `next_embeds` [T, H]."""
    layer = config.get("transformer_layer_config") or config
    eps, hidden = layer["rms_norm_eps"], layer["hidden_size"]
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    head_dim = hidden // heads
    w = {n.removeprefix("midlayer."): t for n, t in tensors.items()}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    g = aux @ w["fc.weight"].T
    normed = rms(g, w["hidden_norm.weight"])
    x = torch.cat([rms(next_embeds, w["input_layernorm.weight"]), normed], dim=-1)
    time = x.shape[0]
    q = (x @ w["self_attn.q_proj.weight"].T).view(time, heads, head_dim)
    k = (x @ w["self_attn.k_proj.weight"].T).view(time, kv_heads, head_dim)
    v = (x @ w["self_attn.v_proj.weight"].T).view(time, kv_heads, head_dim)
    inv_freq = 1.0 / layer["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(time).float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles],
                                                                          -1).sin()[:, None]

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), is_causal=True)
    residual = normed if config.get("norm_before_residual") else g
    h = residual + attended.transpose(0, 1).reshape(time, -1) @ w["self_attn.o_proj.weight"].T
    m = rms(h, w["post_attention_layernorm.weight"])
    mlp = (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) \
        @ w["mlp.down_proj.weight"].T
    return h + mlp


def reference_draft_logits(config: dict, tensors: dict, prenorm: torch.Tensor,
                           lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """[T, draft_vocab] lm_head(norm(prenorm))."""
    layer = config.get("transformer_layer_config") or config
    normed = prenorm * torch.rsqrt(prenorm.pow(2).mean(-1, keepdim=True) + layer["rms_norm_eps"])
    weight = tensors["lm_head.weight"] if lm_head is None else lm_head
    return (normed * tensors["norm.weight"]) @ weight.T
