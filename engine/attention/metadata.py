"""What an attention backend needs to know about one flat batch, built once per step.

The batch is the concatenation of every scheduled request's new tokens, with no padding between
them. Requests with only a few new tokens (decodes, and later draft verification) are attended
together in one padded call; each longer prefill chunk gets a call of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Requests with at most this many new tokens share one padded attention call.
MAX_QUERY_LEN_BATCHED = 16


@dataclass
class BatchedGroup:
    """Requests with short queries, padded to `max_query_len` and attended in one call."""

    token_index: torch.Tensor  # [num_seqs, max_query_len] flat token index; padding repeats a real one
    query_mask: torch.Tensor  # [num_seqs * max_query_len] bool: which padded rows are real
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids (padding: block 0)
    attn_mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_blocks * block_size] bool: may attend
    query_lens: torch.Tensor  # [num_seqs] real query rows of each request
    context_lens: torch.Tensor  # [num_seqs] tokens of each request in the cache after this step
    num_seqs: int
    max_query_len: int


@dataclass
class PrefillChunk:
    """One request's long run of new tokens, attended on its own."""

    token_start: int
    num_tokens: int
    context_len: int  # tokens of this request in the cache after this step, new ones included
    block_table: torch.Tensor  # [num_blocks] block ids covering context_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot (block_id * block_size + offset)
    batched: BatchedGroup | None
    chunks: list[PrefillChunk]
    block_size: int


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
    chunks: list[PrefillChunk] = []
    starts: list[int] = []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        table = block_tables[i]
        for pos in range(ctx_len - q_len, ctx_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(start)
        if q_len <= MAX_QUERY_LEN_BATCHED:
            short.append(i)
        else:
            num_blocks = -(-ctx_len // block_size)
            chunks.append(PrefillChunk(
                token_start=start, num_tokens=q_len, context_len=ctx_len,
                block_table=torch.tensor(table[:num_blocks], dtype=torch.long, device=device),
            ))
        start += q_len
    batched = None
    if short:
        batched = _build_batched_group(
            [starts[i] for i in short], [query_lens[i] for i in short],
            [context_lens[i] for i in short], [block_tables[i] for i in short], block_size, device,
        )
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        batched=batched, chunks=chunks, block_size=block_size,
    )


def _build_batched_group(starts, query_lens, context_lens, block_tables, block_size, device):
    num_seqs = len(starts)
    max_q = max(query_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    token_index = torch.empty(num_seqs, max_q, dtype=torch.long)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for i, (start, q_len, ctx_len) in enumerate(zip(starts, query_lens, context_lens)):
        rows = torch.arange(max_q).clamp_(max=q_len - 1)  # padding repeats the last real token
        token_index[i] = start + rows
        n = -(-ctx_len // block_size)
        tables[i, :n] = torch.tensor(block_tables[i][:n])
    q_lens = torch.tensor(query_lens).view(-1, 1)
    ctx = torch.tensor(context_lens).view(-1, 1, 1)
    query_pos = torch.arange(max_q).view(1, -1, 1).minimum(q_lens.view(-1, 1, 1) - 1)
    # Query row r of a request sits at absolute position ctx - q_len + r and sees keys up to it.
    last_visible = ctx - q_lens.view(-1, 1, 1) + query_pos  # [num_seqs, max_q, 1]
    key_pos = torch.arange(max_blocks * block_size).view(1, 1, -1)
    attn_mask = (key_pos <= last_visible).unsqueeze(1)
    query_mask = (torch.arange(max_q).view(1, -1) < q_lens).reshape(-1)
    return BatchedGroup(
        token_index=token_index.to(device), query_mask=query_mask.to(device),
        block_tables=tables.to(device), attn_mask=attn_mask.to(device),
        query_lens=q_lens.view(-1).to(device), context_lens=ctx.view(-1).to(device),
        num_seqs=num_seqs, max_query_len=max_q,
    )
