"""What an attention backend needs to know about one flat batch, built once per step.

The batch is the concatenation of every scheduled request's new tokens, with no padding between
them. Requests with only a few new tokens (decodes, and later draft verification) are attended
together in one padded call; each longer prefill chunk gets a call of its own.

Everything is laid out on the host and reaches the device in one non-blocking copy; the masks are
then derived on the device. A step therefore never waits for the device to build its inputs, and
no backend call needs a value back from the device (boolean-mask indexing would: it syncs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.core.device import copy_to_device

# Requests with at most this many new tokens share one padded attention call.
MAX_QUERY_LEN_BATCHED = 16


@dataclass
class BatchedGroup:
    """Requests with short queries, padded to `max_query_len` and attended in one call."""

    token_index: torch.Tensor  # [num_seqs, max_query_len] flat token index; padding repeats a real one
    real_rows: torch.Tensor  # [num_real] rows of the padded [num_seqs * max_query_len] layout that are real
    real_token_index: torch.Tensor  # [num_real] their flat token index (token_index at real_rows)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids (padding: block 0)
    query_lens: torch.Tensor  # [num_seqs] real query rows of each request
    context_lens: torch.Tensor  # [num_seqs] tokens of each request in the cache after this step
    num_seqs: int
    max_query_len: int
    block_size: int
    # The padded layout is the flat batch itself (token_index is 0, 1, 2, ... in order): queries
    # are a view of q and the output needs no scatter. Padded steps, and steps of decodes only.
    identity_layout: bool = False
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def attn_mask(self, query_group: int = 1, window: int | None = None) -> torch.Tensor:
        """[num_seqs, 1, query_group * max_query_len, max_blocks * block_size] bool, may attend.

        `query_group` > 1 repeats the rows for grouped-query attention with the query heads of one
        KV head folded into the query dimension; `window` limits each query to its last keys.
        Built on the device once per step and kept."""
        mask = self._masks.get((query_group, window))
        if mask is None:
            mask = causal_paged_mask(self.query_lens, self.context_lens, self.max_query_len,
                                     self.block_tables.shape[1] * self.block_size, window)
            if query_group > 1 and self.max_query_len > 1:
                mask = mask.repeat(1, 1, query_group, 1)
            self._masks[(query_group, window)] = mask
        return mask

    def additive_mask(self, query_group: int, dtype: torch.dtype,
                      window: int | None = None) -> torch.Tensor:
        """`attn_mask` as 0 / -inf in `dtype`, once per step: SDPA turns a boolean mask into
        this on every call, i.e. in every layer."""
        mask = self._masks.get((query_group, dtype, window))
        if mask is None:
            allowed = self.attn_mask(query_group, window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device) \
                .masked_fill_(allowed.logical_not(), float("-inf"))
            self._masks[(query_group, dtype, window)] = mask
        return mask


@dataclass
class PrefillChunk:
    """One request's long run of new tokens, attended on its own."""

    token_start: int
    num_tokens: int
    context_len: int  # tokens of this request in the cache after this step, new ones included
    block_table: torch.Tensor  # [num_blocks] block ids covering context_len
    _masks: dict = field(default_factory=dict, repr=False)
    _short_query: tuple | None = field(default=None, repr=False)

    def as_short_query(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_index [1, n], query_lens [1], context_lens [1], block_tables [1, blocks]): this
        chunk as the CPU's per-row attention (cpu_ops.cpp `paged_attention_small`) takes a
        request. Built once per step; every layer reuses it."""
        if self._short_query is None:
            device = self.block_table.device
            self._short_query = (
                torch.arange(self.token_start, self.token_start + self.num_tokens,
                             device=device).view(1, -1),
                torch.tensor([self.num_tokens], device=device),
                torch.tensor([self.context_len], device=device),
                self.block_table.view(1, -1).contiguous())
        return self._short_query

    def attn_mask(self, window: int | None = None) -> torch.Tensor:
        """[num_tokens, context_len] bool: query i sits at position context_len - num_tokens + i
        and sees the keys up to there (the last `window` of them, where given)."""
        mask = self._masks.get(window)
        if mask is None:
            first_row_position = self.context_len - self.num_tokens
            mask = torch.ones(self.num_tokens, self.context_len, dtype=torch.bool,
                              device=self.block_table.device).tril_(first_row_position)
            if window is not None:
                mask.triu_(first_row_position - window + 1)
            self._masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot (block_id * block_size + offset)
    batched: BatchedGroup | None
    chunks: list[PrefillChunk]
    block_size: int


def causal_paged_mask(query_lens: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                      num_key_slots: int, window: int | None = None) -> torch.Tensor:
    """[num_seqs, 1, max_query_len, num_key_slots] bool. Query row r of a request sits at absolute
    position context_len - query_len + r and sees the keys up to it (the last `window` of them,
    where given); padding rows repeat the last real row."""
    device = query_lens.device
    q_lens = query_lens.view(-1, 1, 1)
    rows = torch.arange(max_query_len, device=device).view(1, -1, 1).minimum(q_lens - 1)
    last_visible = context_lens.view(-1, 1, 1) - q_lens + rows  # [num_seqs, max_q, 1]
    key_pos = torch.arange(num_key_slots, device=device).view(1, 1, -1)
    visible = key_pos <= last_visible
    if window is not None:
        visible &= key_pos > last_visible - window
    return visible.unsqueeze(1)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Lays out attention for requests whose new tokens sit back to back in the flat batch.

    Request i feeds `query_lens[i]` tokens at positions `context_lens[i] - query_lens[i]` up to
    `context_lens[i] - 1`; its KV will live in the blocks of `block_tables[i]`.
    """
    slots: list[int] = []
    short: list[int] = []
    chunk_specs: list[tuple[int, int, int, torch.Tensor]] = []
    starts: list[int] = []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        table = block_tables[i]
        slots.extend([table[pos // block_size] * block_size + pos % block_size
                      for pos in range(ctx_len - q_len, ctx_len)])
        starts.append(start)
        if q_len <= MAX_QUERY_LEN_BATCHED:
            short.append(i)
        else:
            num_blocks = -(-ctx_len // block_size)
            chunk_specs.append((start, q_len, ctx_len,
                                torch.tensor(table[:num_blocks], dtype=torch.long)))
        start += q_len
    host = [torch.tensor(slots, dtype=torch.long), *(spec[3] for spec in chunk_specs)]
    group_fields = None
    if short:
        group_fields = _batched_group_tensors(
            [starts[i] for i in short], [query_lens[i] for i in short],
            [context_lens[i] for i in short], [block_tables[i] for i in short], block_size)
        host.extend(group_fields)
    moved = copy_to_device(host, device)
    slot_mapping, moved = moved[0], moved[1:]
    chunks = [PrefillChunk(token_start=s, num_tokens=n, context_len=c, block_table=table)
              for (s, n, c, _), table in zip(chunk_specs, moved[:len(chunk_specs)])]
    batched = None
    if group_fields is not None:
        token_index, real_rows, real_token_index, tables, q_lens, ctx = moved[len(chunk_specs):]
        batched = BatchedGroup(
            token_index=token_index, real_rows=real_rows, real_token_index=real_token_index,
            block_tables=tables, query_lens=q_lens, context_lens=ctx, num_seqs=len(short),
            max_query_len=token_index.shape[1], block_size=block_size,
            # every request short and of the same length: the padded layout has no padding
            identity_layout=not chunk_specs and len(set(query_lens)) == 1,
        )
    return AttentionMetadata(slot_mapping=slot_mapping, batched=batched, chunks=chunks,
                             block_size=block_size)


def _batched_group_tensors(starts, query_lens, context_lens, block_tables, block_size):
    """Host tensors of a BatchedGroup: token_index, real_rows, real_token_index, block_tables,
    query_lens, context_lens. Built as Python lists and converted once: a few small tensors
    per request cost ~5 ms of host time per step at 64 requests (measured on CPU)."""
    num_seqs = len(starts)
    max_q = max(query_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    token_index: list[int] = []
    tables = [0] * (num_seqs * max_blocks)
    real_rows: list[int] = []
    real_token_index: list[int] = []
    for i, (start, q_len, ctx_len) in enumerate(zip(starts, query_lens, context_lens)):
        # Padding rows repeat the request's last real token.
        token_index.extend(range(start, start + q_len))
        token_index.extend([start + q_len - 1] * (max_q - q_len))
        real_rows.extend(range(i * max_q, i * max_q + q_len))
        real_token_index.extend(range(start, start + q_len))
        n = -(-ctx_len // block_size)
        tables[i * max_blocks:i * max_blocks + n] = block_tables[i][:n]
    fields = (token_index, real_rows, real_token_index, tables, query_lens, context_lens)
    host = torch.tensor(list(itertools.chain(*fields)), dtype=torch.long)
    token_index_t, real_rows_t, real_token_index_t, tables_t, q_lens_t, ctx_t = \
        host.split([len(field) for field in fields])
    return [token_index_t.view(num_seqs, max_q), real_rows_t, real_token_index_t,
            tables_t.view(num_seqs, max_blocks), q_lens_t, ctx_t]
