"""How one layer's attention differs from plain causal softmax(q k^T / sqrt(d)) v: options of the
shared attention, set per layer from the model's config (Mistral's and Gemma's sliding windows,
Gemma's query scale and soft-capped logits). Every backend takes them or steps aside."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class AttentionOptions:
    # A query at position p sees the keys at p - window + 1 up to p (transformers'
    # `kv_idx > q_idx - sliding_window`); None: every earlier key.
    window: int | None = None
    scale: float | None = None  # what q . k is multiplied by; None: 1 / sqrt(head_dim)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)

    @property
    def plain(self) -> bool:
        return self.window is None and self.scale is None and self.softcap is None

    @cached_property  # once per layer, not per call
    def kernel_args(self) -> dict:
        """The compiled CPU attention's arguments (`paged_attention_small`)."""
        return {"window": self.window or 0, "scale": self.scale or 0.0,
                "softcap": self.softcap or 0.0}


PLAIN = AttentionOptions()
