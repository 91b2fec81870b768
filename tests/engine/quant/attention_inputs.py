"""Paged attention inputs shared by the CPU attention tests: random queries, and KV caches whose
requests' blocks are shuffled over the cache."""

from __future__ import annotations

import torch


def attention_inputs(query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed,
                     block_size=16):
    """(q, k_cache, v_cache, token_index, block_tables) for requests of `query_lens` new rows
    each at `context_lens` tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(ids[used:used + n])
        used += n
    width = max(len(t) for t in tables)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen) * 2
    token_index = torch.zeros(len(query_lens), max(query_lens), dtype=torch.long)
    start = 0
    for s, n in enumerate(query_lens):
        token_index[s, :n] = torch.arange(start, start + n)
        start += n
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, token_index, block_tables
