"""The head `specserve train-draft` trains, by architecture, and how each is written.

- "eagle": our own head (engine/spec_decode/eagle_head.py), written as eagle_head.json +
  eagle_head.safetensors; specserve alone reads it.
- "eagle3": EAGLE-3's head (engine/spec_decode/heads_published/eagle3.py), written in the
  published EAGLE / SpecForge layout (heads_published/eagle3_writer.py), which specserve reads
  like any published head and vLLM and SGLang load as `"method": "eagle3"`.

Both train on the same data and losses; the trainer reads one interface of them
(`trained_parameters`, `init_weights`, `attach_lm_head`, `train_first`, `train_forward`,
`train_normed`, `lm_head`, `token_ids`, `feature_layers`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from engine.spec_decode.eagle_head import EagleHead, EagleHeadConfig, default_feature_layers
from engine.spec_decode.heads_published.eagle3 import Eagle3Head
from engine.spec_decode.heads_published.eagle3_writer import (aux_layer_ids, head_arch,
                                                              round_weights, save_eagle3_head)

ARCHITECTURES = ("eagle", "eagle3")


def feature_layers_for(architecture: str, target_arch, eagle3_features: bool) -> list[int]:
    """The target layers the head reads; ValueError for a combination that cannot be trained."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown head architecture {architecture!r} (choose from "
                         f"{', '.join(ARCHITECTURES)})")
    if architecture == "eagle3":
        if not eagle3_features:
            raise ValueError("an EAGLE-3 head reads a low, a middle and a high layer; "
                             "--last-layer-only applies to --architecture eagle only")
        layers = default_feature_layers(target_arch)
        aux_layer_ids(layers)  # refused before training, not after it
        return layers
    return default_feature_layers(target_arch) if eagle3_features else []


def new_head(architecture: str, target, feature_layers: list[int], vocab: torch.Tensor,
             device: torch.device, seed: int) -> EagleHead | Eagle3Head:
    """A freshly initialized head over the draft vocabulary `vocab` (target ids, sorted), its
    LM head the target's rows of it."""
    if architecture == "eagle3":
        head = Eagle3Head(head_arch(target.arch), target.arch, feature_layers, len(vocab))
    else:
        head = EagleHead(target.arch, len(vocab), feature_layers)
    head = head.to(device)
    head.init_weights(torch.Generator(device=device).manual_seed(seed))
    head.token_ids.copy_(vocab)
    head.attach_lm_head(target)
    return head


def write_head(head: EagleHead | Eagle3Head, output: Path, target, target_name: str,
               summary: dict) -> None:
    """Writes the trained head. An EAGLE-3 head is first rounded to the bfloat16 it is written
    in, so that the head in memory drafts exactly what the written one will."""
    if isinstance(head, Eagle3Head):
        round_weights(head, torch.bfloat16)
        save_eagle3_head(head, Path(output), torch.bfloat16,
                         training={"target_name": target_name, **summary})
        return
    config = EagleHeadConfig(asdict(target.arch), head.draft_vocab_size, target_name, summary,
                             list(head.feature_layers) or None)
    head.save(Path(output), config)
