"""Per-rank loading of a float checkpoint: each rank reads only its piece of each tensor into a
model already cut for it on the meta device (shard_model.py) and allocated at shard size.

Every cut module records the full model's rows it keeps (`kept_rows`, in its own row order) and
columns (`kept_columns`); shard.cut_linear and shard_model._shard_vocabulary write them. A
checkpoint tensor's place in the full model (checkpoint_names.place_of: module, parameter, row
offset in a fused q/k/v or gate/up matrix) then translates into pieces by `row_pieces`, a pure
function of (full place, kept rows); the columns are the kept columns as they are. A module that
was not cut (norms, a router) keeps everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.models.checkpoint_names import parts_of, place_of
from engine.models.layers import RMSNorm


@dataclass(frozen=True)
class Piece:
    source_rows: range  # rows of the checkpoint tensor
    target_start: int  # the first row of this rank's parameter that they fill


def row_pieces(out_offset: int, num_rows: int, kept_rows: list[range]) -> list[Piece]:
    """The pieces of a checkpoint tensor filling full rows [out_offset, out_offset + num_rows)
    that a parameter keeping full rows `kept_rows` (in its order) holds; empty where it holds
    none of them (another rank's q_proj rows, a rank past an odd vocabulary's end)."""
    pieces, target = [], 0
    for kept in kept_rows:
        start, stop = max(kept.start, out_offset), min(kept.stop, out_offset + num_rows)
        if start < stop:
            pieces.append(Piece(range(start - out_offset, stop - out_offset),
                                target + start - kept.start))
        target += len(kept)
    return pieces


def checkpoint_module_name(module_name: str) -> str:
    """A module's name in the full model: ReducedExperts wraps a mixture as `.mlp.moe`."""
    return module_name.replace(".mlp.moe.", ".mlp.")


@torch.no_grad()
def load_shard_weights(model, named_sources: Iterable[tuple[str, object]]) -> None:
    """Copies this rank's piece of each checkpoint tensor into `model` (cut by shard_model and
    allocated). A source is a tensor or a safetensors slice (`safe_open(...).get_slice(name)`):
    only the rows and columns indexed are read. Raises ValueError, as load_weights does, for a
    tensor with no place here or parameters left unfilled."""
    modules = {checkpoint_module_name(n): m for n, m in model.named_modules()}
    norm_offset = model.arch.norm_weight_offset
    filled: set[str] = set()
    for name, source in named_sources:
        place = place_of(name, model.arch, tied_embeddings=model.embed_tokens is None)
        if place is None:
            continue
        module_name, param_name, out_offset, part = place
        module = modules.get(module_name)
        if module is None or not hasattr(module, param_name):
            raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
        target = getattr(module, param_name)
        if target is None:
            if param_name == "bias" and getattr(module, "dropped_bias", False):
                continue  # a row-parallel layer's bias, added once: on rank 0
            raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
        shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
        kept_rows = getattr(module, "kept_rows", None) or [range(out_offset + shape[0])]
        columns = getattr(module, "kept_columns", None) if len(shape) == 2 else None
        for piece in row_pieces(out_offset, shape[0], kept_rows):
            rows = slice(piece.source_rows.start, piece.source_rows.stop)
            value = source[rows] if columns is None else source[rows, columns.start:columns.stop]
            if isinstance(module, RMSNorm) and norm_offset:
                value = value.float() + norm_offset  # Gemma stores w and applies 1 + w
            target.narrow(0, piece.target_start, value.shape[0]).copy_(value)
        parts = [part] if part else parts_of(f"{module_name}.{param_name}")
        filled.update(f"{module_name}.{param_name}{p}" for p in parts)
    expected = {f"{checkpoint_module_name(n)}{part}" for n, _ in model.named_parameters()
                for part in parts_of(n)}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
