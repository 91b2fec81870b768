"""The compiled decoder stack (csrc/decoder_stack.cpp): a run of Llama layers in one C++ call on
the CPU float32 path, for the target's layers and for an EAGLE head's one layer alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import AttentionMetadata
from engine.models.architecture import LlamaArchitecture


class CompiledStack:
    """The stack of `layers`, built on first use, or None where it does not apply: a layer
    without fused weights (decoder_layer.py `fused_weights`) or layers with different windows.
    Rebuilt when the rotary tables are (they are bound into it)."""

    def __init__(self):
        self._built, self._cos = None, None

    def get(self, fused, layers: Sequence, arch: LlamaArchitecture, rotary):
        if self._cos is not rotary.cos:
            weights = [layer.fused_weights() for layer in layers]
            one_window = len({arch.window_of(i) for i in range(arch.num_layers)}) == 1
            self._built = None
            if one_window and all(w is not None for w in weights):
                self._built = fused.DecoderStack(
                    [w[:2] + w[3:] for w in weights], weights[0][2], rotary.cos, rotary.sin,
                    arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.window_of(0) or 0)
            self._cos = rotary.cos
        return self._built


def stack_applies(fused, kv_caches, meta: AttentionMetadata) -> bool:
    """The stack runs decode-like steps (no prefill chunk) of the CPU float32 path on one
    KVCache storage."""
    return (fused is not None and getattr(kv_caches, "storage", None) is not None
            and not meta.chunks and meta.batched is not None)


def run_stack(stack, x: torch.Tensor, positions: torch.Tensor, kv_caches,
              meta: AttentionMetadata, layer_ids: Sequence[int]) -> None:
    """Runs `layer_ids` over x in place, writing their KV."""
    group = meta.batched
    stack.run(x, positions.contiguous(), kv_caches.storage, meta.slot_mapping, group.token_index,
              group.query_lens, group.context_lens, group.block_tables, list(layer_ids))
