"""Reads a published EAGLE-3 head folder and refuses one that does not fit the target.

Two layouts, one set of tensors:
- EAGLE / SpecForge (`architectures: ["LlamaForCausalLMEagle3"]`): a Llama config of the head's
  one layer plus `draft_vocab_size` and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`
  and `target_hidden_size`; tensors `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`,
  `d2t`, `t2d`, sometimes `embed_tokens.weight`.
- `speculators` (`speculators_model_type: "eagle3"`): the layer's config under
  `transformer_layer_config`, the rest at the top level; tensors `layers.0.*` for `midlayer.*`,
  and `fc.bias` in early releases.

`d2t[d]` is the offset from draft id d to its target id (target = d + d2t[d]); `t2d` is the
boolean mask of target ids in the draft vocabulary. Which target layers the ids name, and what
else must fit the target: target_fit.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.models.architecture import LlamaArchitecture
from engine.models.layers import Linear
from engine.spec_decode.heads_published.eagle3 import Eagle3Head, PublishedHeadInfo
from engine.spec_decode.heads_published.target_fit import (check_fit, draft_token_ids,
                                                           feature_layers_of)

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# Config keys of EAGLE-3 variants that compute something else, with the value of the plain one
# (gpt-oss heads normalize the features before fc; vLLM scales logits by logit_scale).
UNSERVED_VARIANTS = {"norm_before_fc": False, "logit_scale": 1.0, "parallel_drafting": False}
# Tensors a checkpoint may carry that a served head does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
IGNORED_PREFIXES = ("verifier",)


@dataclass(frozen=True)
class HeadSpec:
    """What the config says about the head, whichever layout wrote it."""

    format: str
    layer_config: dict  # a Llama config of the head's decoder layer
    draft_vocab_size: int | None
    target_hidden_size: int | None
    layer_ids: tuple[int, ...] | None  # EAGLE-3's numbering; None: the default choice
    norm_before_residual: bool


def is_published_head(folder: Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def load_published_head(folder: Path, target, device: torch.device,
                        dtype: torch.dtype) -> Eagle3Head:
    """The EAGLE-3 head in `folder` for `target`; ValueError naming what does not fit."""
    folder = Path(folder)
    spec = read_spec(json.loads((folder / CONFIG_FILE).read_text()), folder)
    tensors = read_tensors(folder)
    head = build_head(spec, tensors, target, folder)
    head = head.to(device=device, dtype=dtype).eval()
    head.token_ids = head.token_ids.long()
    if "lm_head.weight" not in tensors:
        with torch.no_grad():  # the target's LM head rows of the draft vocabulary
            rows = target.lm_head.embedding(head.token_ids.to(target.norm.weight.device))
            head.lm_head.weight = torch.nn.Parameter(rows.to(dtype).clone(), requires_grad=False)
    integer = target.on_integer_kernels()
    for module in head.modules():
        if isinstance(module, Linear):
            module.quantize_to_q8_0() if integer else module.pack_for_cpu()
    logger.info("draft head %s (%s): reads the outputs of target layers %s (0-based), a draft "
                "vocabulary of %d of %d tokens", folder, spec.format, list(head.feature_layers),
                head.draft_vocab_size, target.arch.vocab_size)
    return head


def read_spec(config: dict, folder: Path) -> HeadSpec:
    """What the config says, whichever layout wrote it; ValueError for a variant not served."""
    for key, plain in UNSERVED_VARIANTS.items():
        value = config.get(key, (config.get("transformer_layer_config") or {}).get(key, plain))
        if value != plain:
            raise ValueError(f"{folder}: {key} {value!r} is an EAGLE-3 variant specserve does not "
                             f"serve (only {key} {plain!r})")
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise ValueError(f"{folder}: speculators model type {kind!r} is not served; "
                             f"specserve reads speculators 'eagle3' heads")
        return HeadSpec("speculators-eagle3", dict(config.get("transformer_layer_config") or {}),
                        config.get("draft_vocab_size"), config.get("target_hidden_size"),
                        _ids(config.get("eagle_aux_hidden_state_layer_ids")),
                        bool(config.get("norm_before_residual", False)))
    architectures = config.get("architectures") or []
    if not any(name in EAGLE3_ARCHITECTURES for name in architectures):
        raise ValueError(f"{folder}/{CONFIG_FILE} does not describe an EAGLE-3 head "
                         f"(architectures {architectures}); specserve reads "
                         f"{', '.join(EAGLE3_ARCHITECTURES[:2])}, speculators 'eagle3' heads "
                         f"and its own (eagle_head.json)")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{folder}: eagle_config.use_aux_hidden_state is false (a head reading "
                         f"only the last layer); specserve serves EAGLE-3 heads that read three")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids",
                    config.get("eagle_aux_hidden_state_layer_ids"))
    return HeadSpec("eagle3", config, config.get("draft_vocab_size"),
                    config.get("target_hidden_size"), _ids(ids),
                    bool(config.get("norm_before_residual", False)))


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under one naming: `layers.0.*` for `midlayer.*`, no `model.`."""
    from safetensors.torch import load_file

    index = folder / SHARD_INDEX
    if index.is_file():  # sharded: every file the index names
        raw = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            raw.update(load_file(str(folder / shard)))
    elif (folder / WEIGHT_FILES[0]).is_file():
        raw = load_file(str(folder / WEIGHT_FILES[0]))
    elif (folder / WEIGHT_FILES[1]).is_file():
        raw = torch.load(folder / WEIGHT_FILES[1], map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} has {CONFIG_FILE} but no weights ({' or '.join(WEIGHT_FILES)})")
    tensors = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        if name.endswith(IGNORED_SUFFIXES) or name.startswith(IGNORED_PREFIXES):
            continue
        tensors[name] = tensor
    return tensors


def build_head(spec: HeadSpec, tensors: dict, target, folder: Path) -> Eagle3Head:
    """The head with the checkpoint's weights, on CPU in float32; ValueError where the config,
    the tensors or the target do not fit one another."""
    from transformers import LlamaConfig

    layer_type = spec.layer_config.get("model_type", "llama")
    if layer_type != "llama":
        raise ValueError(f"{folder}: the head's layer is {layer_type!r}; specserve serves "
                         f"EAGLE-3 heads with a Llama layer")
    layer_config = {k: v for k, v in spec.layer_config.items() if k != "model_type"}
    arch = LlamaArchitecture.from_hf_config(LlamaConfig(**layer_config))
    target_arch = target.arch
    # Rotation tables as long as the target's context: heads often state 2048 (their training
    # length) and a position's rotation does not depend on the table's length.
    arch = replace(arch, max_position_embeddings=max(arch.max_position_embeddings,
                                                     target_arch.max_position_embeddings))
    check_fit(spec, arch, target_arch, tensors, folder)
    feature_layers = feature_layers_of(spec, target_arch.num_layers, folder)
    draft_vocab = _draft_vocab_size(spec, tensors, arch)
    head = Eagle3Head(arch, target_arch, feature_layers, draft_vocab,
                      norm_before_residual=spec.norm_before_residual,
                      own_embeddings="embed_tokens.weight" in tensors,
                      fc_bias="fc.bias" in tensors)
    head.config = PublishedHeadInfo(spec.format, str(folder))
    expected = _expected_shapes(head, arch, tensors)

    def shown(names):  # as the checkpoint spells them
        prefix = "midlayer." if spec.format == "eagle3" else "layers.0."
        return ", ".join(n.replace("layers.0.", prefix) for n in sorted(names))

    missing = set(expected) - set(tensors)
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {shown(missing)}")
    unknown = set(tensors) - set(expected)
    if unknown:
        raise ValueError(f"{folder}: tensors specserve has no place for: {shown(unknown)} "
                         f"(one decoder layer expected)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{folder}: {shown([name])} has shape "
                             f"{list(tensors[name].shape)}, expected {list(shape)} for this "
                             f"head and target")
    head.token_ids.copy_(draft_token_ids(tensors, draft_vocab, target_arch.vocab_size, folder))
    _copy_weights(head, tensors)
    return head


def _draft_vocab_size(spec: HeadSpec, tensors: dict, arch: LlamaArchitecture) -> int:
    if spec.draft_vocab_size is not None:
        return int(spec.draft_vocab_size)
    if "d2t" in tensors:
        return tensors["d2t"].shape[0]
    return arch.vocab_size


def _expected_shapes(head: Eagle3Head, arch: LlamaArchitecture, tensors: dict) -> dict:
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    layer = "layers.0."
    shapes = {
        "fc.weight": (hidden, head.fc.in_features), "norm.weight": (hidden,),
        layer + "input_layernorm.weight": (hidden,), layer + "hidden_norm.weight": (hidden,),
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (q, 2 * hidden),
        layer + "self_attn.k_proj.weight": (kv, 2 * hidden),
        layer + "self_attn.v_proj.weight": (kv, 2 * hidden),
        layer + "self_attn.o_proj.weight": (hidden, q),
        layer + "mlp.gate_proj.weight": (inter, hidden),
        layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
    }
    if arch.qkv_bias:
        shapes.update({layer + "self_attn.q_proj.bias": (q,),
                       layer + "self_attn.k_proj.bias": (kv,),
                       layer + "self_attn.v_proj.bias": (kv,)})
    if arch.o_bias:
        shapes[layer + "self_attn.o_proj.bias"] = (hidden,)
    if arch.mlp_bias:
        shapes.update({layer + "mlp.gate_proj.bias": (inter,), layer + "mlp.up_proj.bias": (inter,),
                       layer + "mlp.down_proj.bias": (hidden,)})
    optional = {"fc.bias": (hidden,), "lm_head.weight": (head.draft_vocab_size, hidden),
                "embed_tokens.weight": (arch.vocab_size, hidden),
                "d2t": (head.draft_vocab_size,), "t2d": (arch.vocab_size,)}
    shapes.update({name: shape for name, shape in optional.items() if name in tensors})
    if head.draft_vocab_size != arch.vocab_size:
        shapes.setdefault("d2t", (head.draft_vocab_size,))  # a smaller vocabulary needs its map
    return shapes


@torch.no_grad()
def _copy_weights(head: Eagle3Head, tensors: dict) -> None:
    def get(name):
        return tensors[name].float()

    layer, attn, mlp = "layers.0.", head.layer.self_attn, head.layer.mlp
    head.fc.weight.copy_(get("fc.weight"))
    if head.fc.bias is not None:
        head.fc.bias.copy_(get("fc.bias"))
    head.norm.weight.copy_(get("norm.weight"))
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        getattr(head.layer, norm).weight.copy_(get(f"{layer}{norm}.weight"))
    for fused, parts, prefix in ((attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), "self_attn."),
                                 (mlp.gate_up_proj, ("gate_proj", "up_proj"), "mlp.")):
        fused.weight.copy_(torch.cat([get(f"{layer}{prefix}{p}.weight") for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([get(f"{layer}{prefix}{p}.bias") for p in parts]))
    for single, name in ((attn.o_proj, "self_attn.o_proj"), (mlp.down_proj, "mlp.down_proj")):
        single.weight.copy_(get(f"{layer}{name}.weight"))
        if single.bias is not None:
            single.bias.copy_(get(f"{layer}{name}.bias"))
    if "lm_head.weight" in tensors:
        head.lm_head.weight.copy_(get("lm_head.weight"))
    if head.embed_tokens is not None:
        head.embed_tokens.weight.copy_(get("embed_tokens.weight"))


def _ids(values) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)
