"""The modules a sharded model swaps in (shard_model.py): each holds its rank's piece of a
weight and does the collective that makes its output whole again. The model's own layer code
(decoder_layer.py) is unchanged: these keep the interfaces of what they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import ParallelGroup
from engine.models.layers import Linear


class RowParallelLinear(Linear):
    """O and down projections: this rank's input columns of W, so its product is a partial sum;
    one all-reduce makes it whole, and the residual is added once, after the reduce (the bias
    lives on rank 0 only, for the same reason)."""

    group: ParallelGroup

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.group.all_reduce(super().forward(x))
        return y if residual is None else residual + y


class VocabParallelHead(Linear):
    """The LM head: this rank's vocabulary rows [vocab_start, vocab_start + rows). Its logits
    are all-gathered, so every rank holds the same full row (sampling stays on rank 0 and sees
    exactly what one rank would compute per logit). `out_features` is the full vocabulary, as
    the runner reads it."""

    group: ParallelGroup
    vocab_start: int
    vocab_sizes: list[int]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.group.all_gather_last(super().forward(x, residual), self.vocab_sizes)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """A tied vocabulary matrix as the embedding: masked_lookup over the local rows."""
        return masked_lookup(ids, self.vocab_start, self.vocab_sizes[self.group.rank],
                             super().embedding, self.in_features, self.group)


class VocabParallelEmbedding(nn.Module):
    """An untied embedding cut by vocabulary rows (masked_lookup)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: ParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        return masked_lookup(ids, self.vocab_start, self.weight.shape[0],
                             lambda local: F.embedding(local, self.weight),
                             self.weight.shape[1], self.group)


def masked_lookup(ids: torch.Tensor, start: int, num_rows: int, lookup, width: int,
                  group: ParallelGroup) -> torch.Tensor:
    """Each id's row from the one rank that holds it, zeros on the others, summed over ranks:
    exact (x + 0 == x)."""
    local = ids - start
    inside = (local >= 0) & (local < num_rows)
    if num_rows == 0:  # a rank past the vocabulary's end (tiny vocabularies only)
        rows = torch.zeros(*ids.shape, width, device=ids.device)
    else:
        rows = lookup(local.clamp(0, num_rows - 1))
    rows = torch.where(inside.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype,
                                                                device=rows.device))
    return group.all_reduce(rows.contiguous())


class ReducedExperts(nn.Module):
    """A mixture of experts whose every expert is cut by its intermediate size like the dense
    MLP (each rank holds a slice of all experts, so the load is even whatever the routing);
    the router is replicated, so every rank routes alike, and one all-reduce per layer sums the
    experts' partial outputs."""

    def __init__(self, moe: nn.Module, group: ParallelGroup):
        super().__init__()
        self.moe, self.group = moe, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.moe(x))


class NoCompiledStack:
    """In place of models/stack.CompiledStack: the C++ decoder stack runs whole layers and has
    no all-reduce, so a sharded model always runs layer by layer."""

    def get(self, *_args):
        return None
