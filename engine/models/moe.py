"""A mixture-of-experts MLP (Qwen3-MoE): a router scores every expert for each token, the top k
are kept with their softmax probabilities (renormalised over the k where the model says so), and
each expert, a gated MLP of its own, runs only on the tokens routed to it: all of a step's
requests together, one expert after another."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.architecture import LlamaArchitecture
from engine.models.layers import MLP, Linear  # the experts are the dense layer's MLP


def route(router_logits: torch.Tensor, top_k: int,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k]): softmax in float32, the top k
    (torch.topk's order), renormalised over them where `normalize`, as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoE(nn.Module):
    def __init__(self, arch: LlamaArchitecture):
        super().__init__()

        self.gate = Linear(arch.hidden_size, arch.num_experts)  # the router, as checkpoints name it
        self.experts = nn.ModuleList(MLP(arch, arch.moe_intermediate_size)
                                     for _ in range(arch.num_experts))
        self.top_k, self.normalize = arch.num_experts_per_tok, arch.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        flat = experts.flatten()  # choice j of token t at t * k + j
        # Choices grouped by expert, in token order within each; one read of the counts (a
        # device sync off the CPU) serves every expert of the layer.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count == 0:  # no token chose it: no work
                continue
            choices = order[start:start + count]
            tokens = choices // self.top_k
            y = expert(x.index_select(0, tokens)) * flat_weights[choices].unsqueeze(1)
            out.index_add_(0, tokens, y)
            start += count
        return out
