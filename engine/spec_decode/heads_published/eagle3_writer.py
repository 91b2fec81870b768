"""Writes an EAGLE-3 head in the EAGLE / SpecForge layout, the one eagle3_checkpoint.py reads and
vLLM's and SGLang's `llama_eagle3` load: `config.json` (a Llama config of the head's one layer,
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`,
`eagle_config.eagle_aux_hidden_state_layer_ids`), `model.safetensors` with `midlayer.*`, `fc`,
`norm`, `lm_head` (the draft vocabulary's rows) in bfloat16, int64 `d2t` and bool `t2d`.

The head's layer is a plain Llama layer shaped like the target's: `head_arch` builds it from the
config this module writes, so the head trained in memory and the head read back share one
architecture by construction.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from engine.models.architecture import LlamaArchitecture
from engine.spec_decode.heads_published.eagle3 import Eagle3Head

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "specserve_training.json"  # beside the checkpoint: other engines ignore it
ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def layer_config(target_arch: LlamaArchitecture) -> dict:
    """A Llama config of the head's one decoder layer, shaped like the target's layers."""
    config = {
        "model_type": "llama", "hidden_size": target_arch.hidden_size,
        "intermediate_size": target_arch.intermediate_size,
        "num_attention_heads": target_arch.num_heads,
        "num_key_value_heads": target_arch.num_kv_heads, "head_dim": target_arch.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": target_arch.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": target_arch.max_position_embeddings,
        "rope_theta": target_arch.rope_theta, "vocab_size": target_arch.vocab_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
    if target_arch.rope_scaling is not None:
        config["rope_scaling"] = dict(target_arch.rope_scaling)
    return config


def head_arch(target_arch: LlamaArchitecture) -> LlamaArchitecture:
    """The head layer's architecture as a reader of `layer_config` builds it (the loader's
    path); ValueError where the target's rotation does not survive the config."""
    from transformers import LlamaConfig

    config = {k: v for k, v in layer_config(target_arch).items() if k != "model_type"}
    arch = LlamaArchitecture.from_hf_config(LlamaConfig(**config))
    if (arch.rope_theta, arch.rope_scaling) != (target_arch.rope_theta, target_arch.rope_scaling):
        raise ValueError(f"the target's rotation (theta {target_arch.rope_theta}, scaling "
                         f"{target_arch.rope_scaling}) cannot be written in a Llama config the "
                         f"same way; an EAGLE-3 head for it would be read back differently")
    return replace(arch, max_position_embeddings=target_arch.max_position_embeddings)


def aux_layer_ids(feature_layers) -> list[int]:
    """EAGLE-3's ids of our feature layers: id k is the residual stream after k layers (vLLM's
    counting). Id 1 first would be read as SpecForge's layer-output ids (shifted by one)."""
    ids = [layer + 1 for layer in sorted(feature_layers)]
    if ids[0] == 1:
        raise ValueError("a head reading the first layer's output cannot be written in the "
                         "EAGLE-3 layout unambiguously (id 1 first reads as SpecForge's "
                         "numbering); train it on a target of 4 layers or more")
    return ids


def draft_maps(token_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """`d2t` [draft_vocab] int64 offsets (target = draft + d2t[draft]) and `t2d` [vocab] bool."""
    token_ids = token_ids.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    return {"d2t": token_ids - torch.arange(len(token_ids)), "t2d": t2d}


@torch.no_grad()
def round_weights(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> None:
    """Rounds the head's float weights to `dtype` in place, so that the head in memory drafts
    exactly what the written one will."""
    for param in head.parameters():
        param.copy_(param.to(dtype).to(param.dtype))


def save_eagle3_head(head: Eagle3Head, folder: Path, dtype: torch.dtype = torch.bfloat16,
                     training: dict | None = None) -> Path:
    """Writes `head` (its token ids set, its LM head attached) to `folder`; returns it."""
    from safetensors.torch import save_file

    if head.embed_tokens is not None or head.layer.norm_before_residual:
        raise ValueError("only heads on the target's embeddings, without norm_before_residual, "
                         "are written (the ones `specserve train-draft` trains)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    attn, mlp = head.layer.self_attn, head.layer.mlp
    q, k, v = attn.qkv_proj.weight.split(attn.split_sizes, dim=0)
    gate, up = mlp.gate_up_proj.weight.split(head.arch.intermediate_size, dim=0)
    layer = {
        "input_layernorm.weight": head.layer.input_layernorm.weight,
        "hidden_norm.weight": head.layer.hidden_norm.weight,
        "post_attention_layernorm.weight": head.layer.post_attention_layernorm.weight,
        "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": attn.o_proj.weight,
        "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": mlp.down_proj.weight,
    }
    tensors = {"midlayer." + name: t for name, t in layer.items()}
    tensors.update({"fc.weight": head.fc.weight, "norm.weight": head.norm.weight,
                    "lm_head.weight": head.lm_head.weight})
    if head.fc.bias is not None:
        tensors["fc.bias"] = head.fc.bias
    tensors = {name: t.detach().to(dtype).contiguous().cpu() for name, t in tensors.items()}
    tensors.update(draft_maps(head.token_ids, head.target_arch.vocab_size))
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = dict(layer_config(head.arch), architectures=[ARCHITECTURE],
                  torch_dtype=DTYPE_NAMES[dtype], draft_vocab_size=head.draft_vocab_size,
                  eagle_config={"eagle_aux_hidden_state_layer_ids":
                                aux_layer_ids(head.feature_layers),
                                "use_aux_hidden_state": True})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    if training is not None:
        (folder / TRAINING_FILE).write_text(json.dumps(training, indent=1) + "\n")
    return folder
