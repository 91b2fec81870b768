"""Turns the target's logits at every verified position into the tokens a step emits.

Row j of a sequence holds the target's logits for the token after [last, d_1..d_j]. Each row is
first sampled exactly as non-speculative decoding would sample that position (same processing,
same generator keyed by output position). For drafts without probabilities (n-gram, greedy
drafts) the drafts are then accepted while they equal those samples: the probability that the
sample equals d is p(d) = min(1, p(d) / 1), and given that it differs the sample is distributed as
normalize(max(0, p - onehot(d))), so this *is* modified rejection sampling with a one-hot draft
distribution, and a seeded request gives the same tokens as without speculation. Drafts sampled
from a draft distribution q go through `rejection_sample` with min(1, p / q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import (
    SamplingBatch,
    build_sampling_batch,
    choose_tokens,
    process_logits,
    sample_from_probs,
    target_probs,
)
from engine.spec_decode.rejection_sampler import rejection_sample


@dataclass
class VerifySeq:
    row_start: int  # first logits row of this sequence; it has len(draft_token_ids) + 1 rows
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [num_drafts, vocab] when drafts were sampled


def verify(logits: torch.Tensor,  # [num_rows, vocab] raw
           batch: SamplingBatch,  # settings per row
           seqs: list[VerifySeq]) -> list[list[int]]:
    """Returns, per sequence, its accepted drafts followed by one recovered or bonus token."""
    processed = process_logits(logits, batch)
    row_tokens = choose_tokens(processed, batch).tolist()
    greedy_rows = (batch.temperature == 0).tolist()
    emitted: list[list[int]] = []
    probs_all = None
    for seq in seqs:
        drafts, start = seq.draft_token_ids, seq.row_start
        if seq.draft_probs is None or greedy_rows[start]:
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == row_tokens[start + num_accepted]:
                num_accepted += 1
            emitted.append(drafts[:num_accepted] + [row_tokens[start + num_accepted]])
            continue
        if probs_all is None:
            probs_all = target_probs(processed, batch)
        emitted.append(_verify_sampled_drafts(probs_all, batch, seq))
    return emitted


def verify_requests(requests, row_starts: list[int], logits: torch.Tensor,
                    draft_probs: dict[str, torch.Tensor],
                    shared_generator: torch.Generator) -> list[list[int]]:
    """Per sampling request of a step: its accepted drafts and one new token (just the new
    token without speculation). Row j of a request scores the position after drafts[:j], so
    its penalties see those drafts and its seeded generator is keyed by that position."""
    if not requests:
        return []
    params, prompts, histories, seqs = [], [], [], []
    for request, row_start in zip(requests, row_starts):
        drafts = request.draft_token_ids
        for j in range(len(drafts) + 1):
            params.append(request.sampling_params)
            prompts.append(request.prompt_token_ids)
            histories.append(request.output_token_ids + drafts[:j])
        seqs.append(VerifySeq(row_start, drafts, draft_probs.get(request.request_id)))
    batch = build_sampling_batch(params, prompts, histories, logits.shape[-1], logits.device,
                                 shared_generator)
    return verify(logits, batch, seqs)


def _verify_sampled_drafts(probs_all: torch.Tensor, batch: SamplingBatch, seq: VerifySeq):
    num_drafts, start = len(seq.draft_token_ids), seq.row_start
    device = probs_all.device
    rows = probs_all[start:start + num_drafts + 1].unsqueeze(0)  # [1, k + 1, vocab]
    # Each position's generator continues past the draw `choose_tokens` took from it, so these
    # draws are fresh and, for seeded requests, reproducible.
    generators = batch.generators[start:start + num_drafts + 1]
    uniforms = torch.cat([torch.rand(1, generator=g, device=device) for g in generators[:-1]])
    out = rejection_sample(
        target_probs=rows,
        draft_token_ids=torch.tensor([seq.draft_token_ids], device=device),
        num_drafts=torch.tensor([num_drafts], device=device),
        draft_probs=seq.draft_probs.unsqueeze(0),
        uniforms=uniforms.unsqueeze(0),
        greedy=torch.tensor([False], device=device),
        target_argmax=rows.argmax(dim=-1),
    )
    num_accepted = int(out.num_accepted[0])
    token = int(sample_from_probs(out.next_token_probs, [generators[num_accepted]])[0])
    return seq.draft_token_ids[:num_accepted] + [token]
