"""What a published head must share with its target: the hidden size of the features it reads,
the vocabulary, the target layers it reads (within the target), and a draft vocabulary map into
the target's tokens. Each refusal is a ValueError saying what differs."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.architecture import LlamaArchitecture


def check_fit(spec, arch: LlamaArchitecture, target_arch: LlamaArchitecture, tensors: dict,
              folder: Path) -> None:
    """The head's features, vocabulary, layer count and borrowed tensors against the target."""
    target_hidden = spec.target_hidden_size or arch.hidden_size
    if target_hidden != target_arch.hidden_size:
        raise ValueError(f"{folder}: the head reads features of hidden size {target_hidden}, the "
                         f"target's hidden size is {target_arch.hidden_size}")
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(f"{folder}: the head's vocabulary has {arch.vocab_size} tokens "
                         f"(vocab_size), the target's {target_arch.vocab_size}")
    if arch.num_layers != 1 or any(name.startswith("layers.1.") for name in tensors):
        raise ValueError(f"{folder}: the head has {arch.num_layers} decoder layers; specserve "
                         f"serves one-layer EAGLE-3 heads")
    borrowed = [name for name in ("embed_tokens.weight", "lm_head.weight") if name not in tensors]
    if borrowed and arch.hidden_size != target_arch.hidden_size:
        raise ValueError(f"{folder}: the head lacks {' and '.join(borrowed)} and its hidden size "
                         f"{arch.hidden_size} differs from the target's "
                         f"{target_arch.hidden_size}, so it cannot use the target's")


def feature_layers_of(spec, num_layers: int, folder: Path) -> tuple[int, ...]:
    """Our layer outputs (0-based) for the head's `eagle_aux_hidden_state_layer_ids`.

    The ids count residual-stream boundaries: id k is the stream after k layers (transformers'
    hidden_states[k] before the final norm), as vLLM captures them; without ids, vLLM's and
    SGLang's default (2, n // 2, n - 3). EAGLE/SpecForge configs whose ids start at 1 name layer
    outputs instead (SpecForge's training hooks; SGLang adds 1 to them), so they shift by one.
    """
    ids = spec.layer_ids if spec.layer_ids is not None else (2, num_layers // 2, num_layers - 3)
    shifted = spec.format == "eagle3" and spec.layer_ids is not None and ids[0] == 1
    boundaries = [i + 1 for i in ids] if shifted else list(ids)
    if any(not 1 <= b <= num_layers for b in boundaries) or len(set(ids)) != len(ids):
        reading = " read as layer outputs, as SGLang reads ids starting at 1" if shifted else ""
        raise ValueError(f"{folder}: the head reads target layers {list(ids)} "
                         f"(eagle_aux_hidden_state_layer_ids{reading}), which a target of "
                         f"{num_layers} layers cannot give (distinct boundaries in "
                         f"1..{num_layers}; 0, the embeddings, is not served)")
    return tuple(b - 1 for b in sorted(boundaries))  # the target hands them over in order


def draft_token_ids(tensors: dict, draft_vocab: int, vocab: int, folder: Path) -> torch.Tensor:
    """[draft_vocab] target id of each draft id, checked against the target and `t2d`."""
    base = torch.arange(draft_vocab)
    if "d2t" not in tensors:
        return base
    d2t = tensors["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{folder}: d2t is {d2t.dtype}, expected integer offsets")
    token_ids = base + d2t.long()
    bad = ((token_ids < 0) | (token_ids >= vocab)).nonzero().flatten()
    if len(bad):
        raise ValueError(f"{folder}: d2t maps draft id {bad[0].item()} to target id "
                         f"{token_ids[bad[0]].item()}, outside the target's {vocab} tokens")
    if token_ids.unique().numel() != draft_vocab:
        raise ValueError(f"{folder}: d2t maps two draft ids to the same target id")
    if "t2d" in tensors:
        t2d = tensors["t2d"].bool()
        if int(t2d.sum()) != draft_vocab or not bool(t2d[token_ids].all()):
            raise ValueError(f"{folder}: t2d marks {int(t2d.sum())} target ids, not the "
                             f"{draft_vocab} that d2t maps to")
    return token_ids
