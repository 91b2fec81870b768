"""Drafting with a model, one position at a time: a separate draft model or a subset of the
target's own layers (layer-skip). Both write draft KV at the slots the scheduler reserved."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import build_attention_metadata
from engine.core.request import Request
from engine.models.llama import LlamaForCausalLM
from engine.sample.sampler import (
    TokenHistory,
    argmax_rows,
    build_sampling_batch,
    choose_tokens,
    process_logits,
    target_probs,
)
from engine.spec_decode.proposer import Proposal, Proposer

# Seeded requests draw their drafts from a stream of their own, independent of the target's.
DRAFT_SEED_OFFSET = 7_919


class ModelDrafter(Proposer):
    """`catch_up=True`: the drafter has its own KV pool and first feeds every token it has not
    seen (a draft model). False: it shares the target's KV, exact for all computed tokens, and
    starts from the last token (layer-skip)."""

    def __init__(self, name: str, model: LlamaForCausalLM, kv_cache, block_size: int,
                 device: torch.device, layer_ids: Sequence[int] | None = None,
                 catch_up: bool = True, shared_generator: torch.Generator | None = None):
        self.name = name
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.catch_up = catch_up
        self.keeps_own_kv = catch_up
        self.shared_generator = shared_generator
        self.num_sequential_steps = 0  # of the last propose() call, for the cost model

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        feeds = {i: self._first_feed(requests[i]) for i in active}
        step = 0
        while active:
            picks, probs = self._draft_step([requests[i] for i in active],
                                            [feeds[i] for i in active], [drafts[i] for i in active])
            for i, token, q in zip(active, picks, probs):
                drafts[i].append(token)
                if q is not None:
                    draft_probs[i].append(q)
            step += 1
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            for i in active:
                # The next feed is the draft just made, at the position after the last one fed.
                start = requests[i].num_tokens + step - 1
                feeds[i] = (start, [drafts[i][-1]])
        if self.catch_up:
            for request, k in zip(requests, num_tokens):
                if k > 0:  # fed up to position num_tokens - 1 + (k - 1)
                    request.num_draft_computed_tokens = request.num_tokens - 1 + k
        self.num_sequential_steps = step
        return Proposal(drafts, [torch.stack(q) if q else None for q in draft_probs])

    def _first_feed(self, request: Request) -> tuple[int, list[int]]:
        """(start position, tokens) of the first forward: unseen tokens through the last one."""
        start = request.num_tokens - 1
        if self.catch_up:
            start = min(request.num_draft_computed_tokens, request.num_computed_tokens)
        return start, request.all_token_ids[start:]

    def _draft_step(self, requests, feeds, drafts_so_far):
        input_ids, positions, query_lens, context_lens, last_rows = [], [], [], [], []
        for start, tokens in feeds:
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            last_rows.append(len(input_ids) - 1)
        meta = build_attention_metadata(query_lens, context_lens,
                                        [r.block_table for r in requests], self.block_size,
                                        self.device)
        logits = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
            self.kv_cache, meta, torch.tensor(last_rows, device=self.device),
            layer_ids=self.layer_ids,
        )
        return sample_drafts(logits, requests, drafts_so_far, self.device, self.shared_generator)


def sample_drafts(logits: torch.Tensor, requests, drafts_so_far, device: torch.device,
                  generator: torch.Generator | None):
    """Each request's next draft from the draft's logits [n, vocab], under the request's own
    sampling settings: (picks, per request its distribution q, or None where it decodes greedily
    and the draft is the argmax)."""
    params = [r.sampling_params for r in requests]
    batch = build_sampling_batch(
        params, [r.prompt_token_ids for r in requests],
        [TokenHistory(r.output_token_ids, d, len(d)) for r, d in zip(requests, drafts_so_far)],
        logits.shape[-1], device, generator, seed_offset=DRAFT_SEED_OFFSET,
    )
    if batch.all_greedy:
        return argmax_rows(logits).tolist(), [None] * len(requests)
    processed = process_logits(logits, batch)
    picks = choose_tokens(processed, batch).tolist()
    probs = target_probs(processed, batch)
    return picks, [None if p.greedy else probs[row] for row, p in enumerate(params)]
