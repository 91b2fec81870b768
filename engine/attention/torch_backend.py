"""Portable paged attention: gather KV pages by block table, then `scaled_dot_product_attention`.

Runs on CPU and CUDA alike and is the reference that any faster backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import triton_backend
from engine.attention.metadata import AttentionMetadata, BatchedGroup
from engine.attention.options import PLAIN, AttentionOptions
from engine.quant.kernels import cpu_ops_for


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    backend: str = "torch",  # "triton": decode/verify requests through the Triton kernel
    options: AttentionOptions = PLAIN,
    kv_written: bool = False,  # the caller stored this step's k and v already (a fused op)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Stores the new tokens' KV in the cache, then attends every query to its request's context."""
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    group = meta.batched
    fused = cpu_ops_for(q)
    if group is not None and group.identity_layout and fused is None and backend == "torch":
        # The padded layout is the whole batch: queries are a view, and there is no scatter.
        queries = q.view(group.num_seqs, group.max_query_len, *q.shape[1:]).transpose(1, 2)
        keys = _gather_blocks(k_cache, group.block_tables)
        values = _gather_blocks(v_cache, group.block_tables)
        return _sdpa_folded(queries, keys, values, group, options).transpose(1, 2).flatten(0, 1)
    out = torch.empty_like(q)
    if group is not None and backend == "triton" and options.plain \
            and triton_backend.supports(q, k_cache):
        triton_backend.paged_attention_short(q, k_cache, v_cache, group, out)
    elif group is not None and fused is not None:
        fused.paged_attention_small(q.contiguous(), k_cache, v_cache, group.token_index,
                                    group.query_lens, group.context_lens, group.block_tables, out,
                                    **options.kernel_args)
    elif group is not None:
        # index_select / index_copy_ rather than advanced indexing: the same gathers, at a
        # fraction of the per-call overhead, which adds up over every layer of every step.
        rows = group.token_index.flatten()
        queries = q.index_select(0, rows).view(group.num_seqs, group.max_query_len, *q.shape[1:])
        queries = queries.transpose(1, 2)  # [seqs, heads, max_q, head_dim]
        keys = _gather_blocks(k_cache, group.block_tables)  # [seqs, kv_heads, L, head_dim]
        values = _gather_blocks(v_cache, group.block_tables)
        attended = _sdpa_folded(queries, keys, values, group, options)
        attended = attended.transpose(1, 2).flatten(0, 1)  # [seqs * max_q, heads, head_dim]
        if group.max_query_len == 1:
            out.index_copy_(0, rows, attended)
        else:  # only the real rows; indices from the host, so no boolean mask (a device sync)
            out.index_copy_(0, group.real_token_index, attended.index_select(0, group.real_rows))
    for chunk in meta.chunks:
        if fused is not None:
            # Row by row, in a fixed key order, as decode and verify rows: a position's result is
            # then bitwise the same whichever way its prompt was cut into chunks or batched.
            # SDPA's matrix products are not (their blocking follows the row count), and on the
            # integer path a last-bit difference can change an activation's 8-bit rounding.
            fused.paged_attention_small(q.contiguous(), k_cache, v_cache, *chunk.as_short_query(),
                                        out, **options.kernel_args)
            continue
        span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        queries = q[span].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        within_window = options.window is None or chunk.num_tokens <= options.window
        if chunk.context_len == chunk.num_tokens and within_window:
            # The whole context is new and within the window: attend to the fresh k/v directly,
            # no gather needed.
            keys = k[span].transpose(0, 1).unsqueeze(0)
            values = v[span].transpose(0, 1).unsqueeze(0)
            attended = _sdpa(queries, keys, values, options, is_causal=True)
        else:
            keys = _gather_context(k_cache, chunk.block_table, chunk.context_len)
            values = _gather_context(v_cache, chunk.block_table, chunk.context_len)
            attended = _sdpa(queries, keys, values, options,
                             attn_mask=chunk.attn_mask(options.window))
        out[span] = attended.squeeze(0).transpose(0, 1)
    return out


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [num_blocks, block_size, kv_heads, d] -> [seqs, kv_heads, max_blocks * block_size, d]
    num_seqs, max_blocks = block_tables.shape
    gathered = cache.index_select(0, block_tables.flatten())
    return gathered.view(num_seqs, max_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int):
    # [num_blocks, block_size, kv_heads, d] -> [1, kv_heads, context_len, d]
    return cache.index_select(0, block_table).flatten(0, 1)[:context_len].transpose(0, 1) \
        .unsqueeze(0)


def _sdpa_folded(q, k, v, group: BatchedGroup, options: AttentionOptions):
    """Grouped-query attention without copying KV: the query heads that share a KV head are
    folded into the query-length dimension, and the mask rows repeated to match (once per step,
    not per layer)."""
    batch, num_heads, q_len, head_dim = q.shape
    query_group = num_heads // k.shape[1]
    attn_mask = group.additive_mask(query_group, q.dtype, options.window)

    def attend(q, k, v):
        if q.device.type == "cpu" or options.softcap is not None:  # SDPA has no soft-cap
            return _attend_small(q, k, v, attn_mask, options)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=options.scale)

    if query_group == 1:
        return attend(q, k, v)
    q = q.reshape(batch, k.shape[1], query_group * q_len, head_dim)
    out = attend(q, k, v)
    # reshape, not view: CUDA's float32 SDPA kernels may return a non-contiguous layout.
    return out.reshape(batch, num_heads, q_len, head_dim)


def _attend_small(q, k, v, attn_mask, options: AttentionOptions = PLAIN):
    """softmax(q k^T / sqrt(d) + mask) v as three batched matmuls (`attn_mask` additive): for
    the few queries per request of decode and verify steps on CPU this costs tens of
    microseconds per layer, where SDPA's CPU flash kernel spent ~1 ms (measured, SmolLM2 decode
    at batch 1). Soft-capping, where asked, comes after the scale and before the mask, as in
    transformers' Gemma 2."""
    scale = options.scale if options.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if options.softcap is not None:
        scores = scores.div_(options.softcap).tanh_().mul_(options.softcap)
    return torch.matmul(torch.softmax(scores.add_(attn_mask), dim=-1), v)


def _sdpa(q, k, v, options: AttentionOptions, attn_mask=None, is_causal=False):
    if k.shape[1] != q.shape[1]:
        # Grouped-query attention: each KV head serves num_heads / num_kv_heads query heads.
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if options.softcap is not None:  # SDPA has no soft-cap: the written-out form
        if is_causal:
            attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                                   device=q.device).tril_()
        additive = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device) \
            .masked_fill_(attn_mask.logical_not(), float("-inf"))
        return _attend_small(q, k, v, additive, options)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=options.scale)
