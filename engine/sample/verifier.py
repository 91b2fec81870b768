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

from engine.core.device import copy_to_device
from engine.grammar.masks import build_bitmask
from engine.sample.rejection_sampler import rejection_sample
from engine.sample.sampler import (
    SamplingBatch,
    TokenHistory,
    argmax_rows,
    build_sampling_batch,
    choose_tokens,
    draw_tokens,
    process_logits,
    row_uniforms,
    target_probs,
)


@dataclass
class VerifySeq:
    row_start: int  # first logits row of this sequence; it has len(draft_token_ids) + 1 rows
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [num_drafts, vocab] when drafts were sampled
    greedy: bool = False  # the request decodes greedily: drafts must equal the argmax


@dataclass
class RowFlags:
    """Integers per logits row computed on the device (engine/failures.py: which rows were NaN),
    read in the step's one copy with its tokens, so that checking them costs no second wait for
    the device."""

    device: torch.Tensor  # [num_rows] int64
    host: list[int] | None = None  # filled in by the read

    def read(self) -> list[int]:
        if self.host is None:  # no verification read them (an empty batch, a failed one)
            self.host = read_tokens(self.device)
        return self.host


def verify(logits: torch.Tensor,  # [num_rows, vocab] raw
           batch: SamplingBatch,  # settings per row
           seqs: list[VerifySeq],
           flags: RowFlags | None = None) -> list[list[int]]:
    """Returns, per sequence, its accepted drafts followed by one recovered or bonus token.

    Everything is decided on the logits' device; the host reads the outcome once, in one copy
    (every row's sampled token, then each sampled-draft sequence's accepted count and next token,
    then `flags`, whose host values it fills in).
    """
    processed = process_logits(logits, batch)
    row_tokens = choose_tokens(processed, batch)  # what a step without drafts samples
    sampled = [i for i, seq in enumerate(seqs) if seq.draft_probs is not None and not seq.greedy]
    if sampled:
        num_accepted, next_tokens = _verify_sampled_drafts(
            target_probs(processed, batch), batch, [seqs[i] for i in sampled])
        row_tokens = torch.cat([row_tokens, num_accepted, next_tokens])
    if flags is not None:
        row_tokens = torch.cat([row_tokens, flags.device])
    host = read_tokens(row_tokens)
    num_rows = logits.shape[0]
    if flags is not None:
        flags.host = host[len(host) - num_rows:]
    outcome = {i: (host[num_rows + n], host[num_rows + len(sampled) + n])
               for n, i in enumerate(sampled)}
    emitted: list[list[int]] = []
    for index, seq in enumerate(seqs):
        drafts, start = seq.draft_token_ids, seq.row_start
        if index in outcome:
            num_accepted, token = outcome[index]
        else:
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == host[start + num_accepted]:
                num_accepted += 1
            token = host[start + num_accepted]
        emitted.append(drafts[:num_accepted] + [token])
    return emitted


def read_tokens(tokens: torch.Tensor) -> list[int]:
    """The step's one device-to-host copy (on a GPU, where the host waits for the device)."""
    return tokens.tolist()


def verify_requests(requests, row_starts: list[int], logits: torch.Tensor,
                    draft_probs: dict[str, torch.Tensor],
                    shared_generator: torch.Generator,
                    bitmask: torch.Tensor | None = None,
                    flags: RowFlags | None = None) -> list[list[int]]:
    """Per sampling request of a step: its accepted drafts and one new token (just the new
    token without speculation). Row j of a request scores the position after drafts[:j], so
    its penalties see those drafts, its grammar mask is the one after those drafts, and its seeded
    generator is keyed by that position. `bitmask`: the step's grammar masks where the caller
    built them already (masks.py `build_bitmask`, the same rows). `flags`: read with the tokens
    (`RowFlags`)."""
    if not requests:
        return []
    batch, seqs = verify_batch(requests, row_starts, logits, draft_probs, shared_generator,
                               bitmask)
    return verify(logits, batch, seqs, flags)


def sample_on_device(requests, row_starts: list[int], logits: torch.Tensor,
                     shared_generator: torch.Generator) -> torch.Tensor:
    """One token per request, left on the device: what `verify_requests` samples for requests
    without drafts (the same processing and draws), for a caller that reads it later
    (overlapped steps, engine/runner/overlap.py)."""
    batch, _seqs = verify_batch(requests, row_starts, logits, {}, shared_generator)
    return choose_tokens(process_logits(logits, batch), batch)


def verify_batch(requests, row_starts: list[int], logits: torch.Tensor,
                 draft_probs: dict[str, torch.Tensor], shared_generator: torch.Generator,
                 bitmask: torch.Tensor | None = None) -> tuple[SamplingBatch, list[VerifySeq]]:
    """The sampling settings of every verified row, and each request's sequence of rows."""
    params, prompts, histories, seqs = [], [], [], []
    for request, row_start in zip(requests, row_starts):
        drafts = request.draft_token_ids
        for j in range(len(drafts) + 1):
            params.append(request.sampling_params)
            prompts.append(request.prompt_token_ids)
            histories.append(TokenHistory(request.output_token_ids, drafts, j))
        seqs.append(VerifySeq(row_start, drafts, draft_probs.get(request.request_id),
                              request.sampling_params.greedy))
    batch = build_sampling_batch(params, prompts, histories, logits.shape[-1], logits.device,
                                 shared_generator)
    if bitmask is None:
        bitmask = build_bitmask(requests, row_starts, logits.shape[0])
    batch.bitmask = bitmask  # the target's distribution at every verified position is the masked one
    return batch, seqs


def _verify_sampled_drafts(probs_all: torch.Tensor, batch: SamplingBatch,
                           seqs: list[VerifySeq]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of every sequence whose drafts came with probabilities, in one batch
    on the device. Returns ([num_seqs] accepted drafts, [num_seqs] next token)."""
    device = probs_all.device
    max_k = max(len(seq.draft_token_ids) for seq in seqs)
    # Row j of a sequence: its (j)th verified position; positions past its own K repeat its last.
    rows = [[seq.row_start + min(j, len(seq.draft_token_ids)) for j in range(max_k + 1)]
            for seq in seqs]
    drafts = [seq.draft_token_ids + [0] * (max_k - len(seq.draft_token_ids)) for seq in seqs]
    rows_t, drafts_t, num_drafts = copy_to_device(
        [torch.tensor(rows, dtype=torch.long), torch.tensor(drafts, dtype=torch.long),
         torch.tensor([len(seq.draft_token_ids) for seq in seqs], dtype=torch.long)], device)
    target = probs_all[rows_t]  # [num_seqs, max_k + 1, vocab]
    draft_probs = torch.stack([
        torch.nn.functional.pad(seq.draft_probs, (0, 0, 0, max_k - len(seq.draft_token_ids)))
        for seq in seqs])
    # Each position's generator continues past the draw `choose_tokens` took from it, so these
    # draws are fresh and, for seeded requests, reproducible: per position one uniform (for its
    # draft) and then one more (for the token that may follow, drawn by inverse CDF).
    generators = [[batch.generators[seq.row_start + j]
                   for j in range(len(seq.draft_token_ids) + 1)] for seq in seqs]
    # padding past a sequence's own drafts: 1, rejected (and masked)
    uniforms = torch.ones(len(seqs), max_k, dtype=torch.float64, device=device)
    for i, gens in enumerate(generators):
        uniforms[i, :len(gens) - 1] = row_uniforms(gens[:-1], device)
    out = rejection_sample(
        target_probs=target, draft_token_ids=drafts_t, num_drafts=num_drafts,
        draft_probs=draft_probs, uniforms=uniforms,
        greedy=torch.zeros(len(seqs), dtype=torch.bool, device=device),
        target_argmax=argmax_rows(target),
    )
    # One uniform per position for the token that may follow it (positions past a sequence's
    # own drafts are never chosen); the accepted prefix picks whose.
    follow = torch.zeros(len(seqs), max_k + 1, dtype=torch.float64, device=device)
    for i, gens in enumerate(generators):
        follow[i, :len(gens)] = row_uniforms(gens, device)
    chosen = follow.gather(1, out.num_accepted.view(-1, 1)).squeeze(1)
    return out.num_accepted, draw_tokens(out.next_token_probs, chosen)
