"""Runs one model over one scheduled step: flat inputs in, logits at the sampled positions out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.core.device import copy_to_device
from engine.core.kv_cache import KVCache
from engine.core.scheduler import ScheduledRequest
from engine.models.llama import LlamaForCausalLM


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] flat rows whose logits are wanted
    # Requests that sample this step (indices into the scheduled list) and where their logits
    # rows begin: one row for the last own token, then one per draft token.
    logits_owners: list[int]
    logits_row_starts: list[int]
    # Per scheduled request, the row of its first fed token in the step's hidden states.
    token_row_starts: list[int]

    @property
    def num_rows(self) -> int:
        """Rows the forward computes: every fed token, no padding."""
        return self.input_ids.shape[0]

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]


def build_model_input(scheduled: Sequence[ScheduledRequest], block_size: int,
                      device: torch.device) -> ModelInput:
    """Concatenates every request's new tokens and then its draft tokens, with no padding
    between requests."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens, context_lens, block_tables = [], [], []
    logits_indices, logits_owners, logits_row_starts, token_row_starts = [], [], [], []
    for owner, s in enumerate(scheduled):
        request = s.request
        token_row_starts.append(len(input_ids))
        start = request.num_computed_tokens
        drafts = request.draft_token_ids
        input_ids.extend(request.all_token_ids[start:start + s.num_new_tokens])
        input_ids.extend(drafts)
        end = start + s.num_fed_tokens
        positions.extend(range(start, end))
        query_lens.append(s.num_fed_tokens)
        context_lens.append(end)
        block_tables.append(request.block_table)
        if s.samples_token:
            last_own = len(input_ids) - len(drafts) - 1
            logits_owners.append(owner)
            logits_row_starts.append(len(logits_indices))
            logits_indices.extend(range(last_own, last_own + len(drafts) + 1))
    input_ids_t, positions_t, logits_indices_t = copy_to_device(
        [torch.tensor(v, dtype=torch.long) for v in (input_ids, positions, logits_indices)], device)
    return ModelInput(
        input_ids=input_ids_t,
        positions=positions_t,
        attention=build_attention_metadata(query_lens, context_lens, block_tables, block_size,
                                           device),
        logits_indices=logits_indices_t,
        logits_owners=logits_owners,
        logits_row_starts=logits_row_starts,
        token_row_starts=token_row_starts,
    )


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> ModelInput:
        return build_model_input(scheduled, self.kv_cache.block_size, self.device)

    def run(self, model_input: ModelInput, known_tokens: dict[int, int] | None = None):
        """`execute` (the runner interface's name for it)."""
        return self.execute(model_input, known_tokens)

    def fed_token_ids(self, model_input: ModelInput) -> torch.Tensor:
        """The tensor the step's forward reads its token ids from."""
        return model_input.input_ids

    def row_cost(self, num_seqs: int):
        """None: a flat step computes one row per fed token, whoever drafts."""
        return None

    def execute(self, model_input: ModelInput,
                known_tokens: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [num_tokens, hidden], logits [num_logits, vocab] float32).
        `known_tokens` {logits row: token}: rows whose masked distribution is one token
        (grammar/masks.py `known_next_tokens`) get a one-hot row (0 there, -inf elsewhere)
        instead of the LM head: each verified row of a CPU step costs ~8% of the step there."""
        hidden = self.model.hidden_states(model_input.input_ids, model_input.positions,
                                          self.kv_cache, model_input.attention)
        indices = model_input.logits_indices
        vocab = self.model.lm_head.out_features
        known = {row: token for row, token in (known_tokens or {}).items() if token < vocab}
        if not known:
            return hidden, self.model.logits(hidden, indices)
        logits = torch.full((indices.shape[0], vocab), float("-inf"), device=hidden.device)
        computed = [row for row in range(indices.shape[0]) if row not in known]
        rows, known_rows, tokens = copy_to_device(
            [torch.tensor(v, dtype=torch.long) for v in (computed, list(known), list(known.values()))],
            hidden.device)
        if computed:
            logits[rows] = self.model.logits(hidden, indices[rows])
        logits[known_rows, tokens] = 0.0
        return hidden, logits
