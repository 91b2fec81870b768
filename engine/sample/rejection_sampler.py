"""Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched, as pure functions.

Words used throughout:
- *draft* tokens d_1..d_K are proposed by a cheap proposer; the target scores all K+1 positions
  [last, d_1..d_K] in one forward pass, giving target distributions p_1..p_{K+1}.
- *accepted*: d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)), q_i being the draft's
  distribution (one-hot for proposers without probabilities, such as n-gram lookup). Greedy
  requests accept while d_i equals argmax p_i.
- *recovered*: at the first rejection, position i, the next token is drawn from
  normalize(max(0, p_i - q_i)), which makes every emitted token exactly p-distributed.
- *bonus*: when all K drafts are accepted, one more token is drawn from p_{K+1}.

A verify step therefore emits num_accepted + 1 tokens (accepted drafts, then one recovered or
bonus token). All distributions are taken after the request's temperature / top-k / top-p, so the
output is distributed exactly as non-speculative sampling with those settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    num_accepted: torch.Tensor  # [num_seqs] long: accepted drafts per sequence
    next_token_probs: torch.Tensor  # [num_seqs, vocab]: recovered / bonus distribution


def accept_drafts(
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] long (padding: any valid id)
    num_drafts: torch.Tensor,  # [num_seqs] long
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab]; None: one-hot drafts
    uniforms: torch.Tensor,  # [num_seqs, max_k] uniform [0, 1) draws
    greedy: torch.Tensor,  # [num_seqs] bool
    target_argmax: torch.Tensor,  # [num_seqs, max_k + 1] long: the greedy choice per position
) -> torch.Tensor:  # [num_seqs] long: the number of leading drafts accepted
    max_k = draft_token_ids.shape[1]
    if max_k == 0:
        return torch.zeros_like(num_drafts)
    drafted = draft_token_ids.unsqueeze(-1)
    target_p = target_probs[:, :max_k].gather(-1, drafted).squeeze(-1)  # [num_seqs, max_k]
    if draft_probs is None:
        draft_q = torch.ones_like(target_p)
    else:
        draft_q = draft_probs.gather(-1, drafted).squeeze(-1)
    # u < p / q accepts with probability min(1, p / q); written as u * q < p to avoid 0 / 0.
    accepted_sampled = uniforms * draft_q < target_p
    accepted_greedy = draft_token_ids == target_argmax[:, :max_k]
    accepted = torch.where(greedy.unsqueeze(1), accepted_greedy, accepted_sampled)
    positions = torch.arange(max_k, device=accepted.device).unsqueeze(0)
    accepted &= positions < num_drafts.unsqueeze(1)
    # Only the unbroken run of acceptances from the first draft counts.
    return accepted.long().cumprod(dim=1).sum(dim=1)


def next_token_probs(
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    num_drafts: torch.Tensor,  # [num_seqs]
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab]; None: one-hot drafts
    num_accepted: torch.Tensor,  # [num_seqs]
) -> torch.Tensor:  # [num_seqs, vocab]
    """The distribution of the token after the accepted drafts: the residual max(0, p - q) at a
    rejection (recovered), or the target's own distribution when every draft was accepted (bonus)."""
    seq_index = torch.arange(target_probs.shape[0], device=target_probs.device)
    p = target_probs[seq_index, num_accepted]  # [num_seqs, vocab]
    rejected = num_accepted < num_drafts
    if draft_token_ids.shape[1] == 0:
        return p
    at = num_accepted.clamp(max=draft_token_ids.shape[1] - 1)
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[seq_index, draft_token_ids[seq_index, at]] = 1.0
    else:
        q = draft_probs[seq_index, at]
    residual = (p - q).clamp_(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass == 0 only if p <= q everywhere, i.e. p == q, where a rejection cannot happen; guard
    # against float round-off all the same.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    return torch.where(rejected.unsqueeze(1), residual, p)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor,
) -> RejectionOutput:
    """Accepts a prefix of each sequence's drafts and returns the distribution of the token that
    follows it. The caller draws that token (argmax for greedy sequences)."""
    num_accepted = accept_drafts(target_probs, draft_token_ids, num_drafts, draft_probs, uniforms,
                                 greedy, target_argmax)
    probs = next_token_probs(target_probs, draft_token_ids, num_drafts, draft_probs, num_accepted)
    # Greedy is the limit of one-hot target distributions: the next token is the target's
    # argmax. The residual max(0, p - q) of a sampled draft q can peak elsewhere. (Computed for
    # every row: asking the device whether any row is greedy would make the host wait.)
    chosen = target_argmax.gather(1, num_accepted.unsqueeze(1))  # [num_seqs, 1]
    one_hot = torch.zeros_like(probs).scatter_(1, chosen, 1.0)
    probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return RejectionOutput(num_accepted=num_accepted, next_token_probs=probs)
