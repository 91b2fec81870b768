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
    # (rows, sources): rows that feed a token still in flight (overlap.py), and each one's row
    # in the token tensor of the step in flight
    in_flight: tuple[list[int], list[int]] | None = None

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

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                in_flight: dict[int, int] | None = None) -> ModelInput:
        """`in_flight` {id(request): row in the token tensor of the step in flight}: requests
        whose fed token is that step's, not yet read; `feed_in_flight` writes them."""
        model_input = build_model_input(scheduled, self.kv_cache.block_size, self.device)
        if in_flight:
            feeding = [(row, in_flight[id(s.request)])
                       for s, row in zip(scheduled, model_input.token_row_starts)
                       if id(s.request) in in_flight]
            model_input.in_flight = ([row for row, _ in feeding], [src for _, src in feeding])
        return model_input

    def feed_in_flight(self, model_input: ModelInput, tokens: torch.Tensor) -> None:
        """Writes, on the device, the tokens in flight into the rows that feed them."""
        if not model_input.in_flight:
            return
        rows, sources = copy_to_device([torch.tensor(v) for v in model_input.in_flight],
                                       tokens.device)
        model_input.input_ids.index_copy_(0, rows, tokens.index_select(0, sources))

    def greedy_tokens(self, model_input: ModelInput, logits: torch.Tensor) -> None:
        """None: a flat step's greedy tokens are the sampler's (the padded runner's graph
        takes them itself)."""
        return None

    def run(self, model_input: ModelInput, known_tokens: dict[int, int] | None = None,
            capture_features: bool = True):
        """`execute` (the runner interface's name for it)."""
        return self.execute(model_input, known_tokens, capture_features)

    def row_cost(self, num_seqs: int):
        """None: a flat step computes one row per fed token, whoever drafts."""
        return None

    def execute(self, model_input: ModelInput, known_tokens: dict[int, int] | None = None,
                capture_features: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [num_tokens, hidden], logits [num_logits, vocab] float32); without
        `capture_features`, hidden leaves out the model's feature layers (a draft head's).
        `known_tokens` {logits row: token}: rows whose masked distribution is one token
        (grammar/masks.py `known_next_tokens`) get a one-hot row (0 there, -inf elsewhere)
        instead of the LM head: each verified row of a CPU step costs ~8% of the step there."""
        hidden = self.model.hidden_states(model_input.input_ids, model_input.positions,
                                          self.kv_cache, model_input.attention,
                                          capture_features=capture_features)
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
