"""Building blocks of a decoder: a layout-aware linear layer, RMSNorm and rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.architecture import LlamaArchitecture


class Linear(nn.Module):
    """y = x W^T + b, with W stored in whichever layout streams fastest for its shape.

    Decoding multiplies one row per request by each weight matrix, so it is bound by how fast the
    weights stream from memory. Measured on x86 CPUs with MKL (batch 1, float32): a matrix that
    widens (out >= in: q/k/v, gate/up, LM head) runs ~1.5-2x faster stored as [in, out] and used as
    `x @ W`; one that narrows (down projection) runs faster in the usual [out, in] layout.
    `load` takes checkpoint tensors in the usual [out, in] layout either way.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.transposed = out_features >= in_features
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, out_offset: int = 0) -> None:
        """Copies a checkpoint weight ([out, in]) or bias ([out]) into rows out_offset onward."""
        if name == "bias":
            self.bias.narrow(0, out_offset, tensor.shape[0]).copy_(tensor)
        elif self.transposed:
            self.weight.narrow(1, out_offset, tensor.shape[0]).copy_(tensor.t())
        else:
            self.weight.narrow(0, out_offset, tensor.shape[0]).copy_(tensor)

    def rows_as_embedding(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T, in_features]
        """Looks up columns of W^T, i.e. rows of W: a tied LM head doubles as the embedding."""
        if self.transposed:
            return self.weight.index_select(1, token_ids).t()
        return self.weight.index_select(0, token_ids)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with cos/sin tables precomputed for every position."""

    def __init__(self, arch: LlamaArchitecture):
        super().__init__()
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, arch.rope_inv_freq())  # [max_pos, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions, q, k):  # positions [T]; q [T, H, D]; k [T, Hkv, D]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
