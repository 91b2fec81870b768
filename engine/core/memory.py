"""How much accelerator memory the KV cache gets, the way vLLM sizes it.

`--gpu-memory-utilization F` is the share of the card's *total* memory this server may hold:
weights, the peak activations of the largest step (measured by a profiling forward), and the KV
cache, which gets the rest. Other processes' memory is not ours to spend: when the card has less
free than F asks for, the server refuses to start with one line saying what to pass.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import build_attention_metadata
from engine.config import EngineConfig
from engine.core.device import free_memory_bytes, synchronize, total_memory_bytes
from engine.core.kv_cache import KVCache, num_blocks_for_budget

GIB = 2**30
# KV cache size on CPU when no budget is given (1 GiB holds ~23k tokens of SmolLM2-135M in
# float32); on a GPU, --gpu-memory-utilization decides.
CPU_KV_CACHE_GIB = 1.0
CPU_KV_MEMORY_BYTES = int(CPU_KV_CACHE_GIB * GIB)


def num_kv_blocks(config: EngineConfig, model, dtype: torch.dtype, device: torch.device,
                  free_at_start: int | None, max_model_len: int) -> int:
    """KV blocks of the target model: given outright, from --kv-cache-memory, 1 GiB on CPU, or
    on a GPU the share of --gpu-memory-utilization that the weights and the profiled largest
    steps leave. `free_at_start`: free accelerator memory before the model loaded (None on
    CPU)."""
    cache, scheduler, spec = config.cache, config.scheduler, config.speculative
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gib is not None:
        budget = int(cache.kv_cache_memory_gib * GIB)
    elif free_at_start is None:
        budget = CPU_KV_MEMORY_BYTES
    else:
        max_k = spec.num_speculative_tokens if spec.enabled else 0
        profile_forward(model, cache.block_size, dtype, device,
                        scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (max_k + 1),
                        scheduler.max_num_seqs, max_k + 1, max_model_len)
        budget = gpu_kv_cache_budget(total_memory_bytes(device), free_at_start,
                                     free_at_start - free_memory_bytes(device),
                                     cache.gpu_memory_utilization)
        if spec.speculative_method == "draft":
            # The draft's own KV pool has as many blocks, each no larger than the target's for
            # a draft smaller than the target: half the budget each.
            budget //= 2
    return num_blocks_for_budget(model.kv_arch, cache.block_size, dtype, budget)


def gpu_kv_cache_budget(total: int, free_at_start: int, used_by_us: int,
                        utilization: float) -> int:
    """Bytes for the KV cache. `free_at_start`: free on the card before this server loaded
    anything; `used_by_us`: what loading and the profiling forward took since (weights and the
    allocator's activation pool)."""
    allowed = int(total * utilization)
    if allowed > free_at_start:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} asks for {allowed / GIB:.1f} GiB of the "
            f"GPU's {total / GIB:.1f} GiB, but only {free_at_start / GIB:.1f} GiB are free (other "
            f"processes hold the rest); pass --gpu-memory-utilization "
            f"{_round_down(free_at_start / total * 0.98):g} or less")
    budget = allowed - used_by_us
    if budget <= 0:
        raise ValueError(
            f"the weights and activations take {used_by_us / GIB:.2f} GiB, all of the "
            f"{allowed / GIB:.2f} GiB that --gpu-memory-utilization {utilization:g} allows; "
            f"raise it, or lower --max-num-batched-tokens, --max-num-seqs or --max-model-len")
    return budget


def _round_down(fraction: float) -> float:
    return max(int(fraction * 100) / 100, 0.01)


def profile_forward(model, block_size: int, dtype: torch.dtype, device: torch.device,
                    num_tokens: int, num_logits: int, max_num_seqs: int, max_query_len: int,
                    max_model_len: int) -> None:
    """Runs the steps with the largest working sets the scheduler can make, so that the
    allocator's peak includes them: a prefill chunk of `num_tokens` that ends at `max_model_len`
    (its attention reads the whole context), then `max_num_seqs` decode/verify queries of
    `max_query_len` tokens, each attending to `max_model_len` keys (a padded or batched step
    reads every request's table as wide as the longest one's). Both run over a throwaway KV
    cache of a few blocks that every block table points into, so their attention gathers and
    scores as many keys as the real steps would, without holding their KV."""
    num_tokens = min(num_tokens, max_model_len)
    _profile_step(model, block_size, dtype, device, [num_tokens], [max_model_len],
                  min(num_logits, num_tokens))
    _profile_step(model, block_size, dtype, device, [max_query_len] * max_num_seqs,
                  [max_model_len] * max_num_seqs, max_num_seqs * max_query_len)


def _profile_step(model, block_size: int, dtype: torch.dtype, device: torch.device,
                  query_lens: list[int], context_lens: list[int], num_logits: int) -> None:
    num_cache_blocks = -(-max(query_lens) // block_size) + 1
    kv_cache = KVCache(model.kv_arch, num_cache_blocks, block_size, dtype, device)
    width = -(-max(context_lens) // block_size)
    table = [i % num_cache_blocks for i in range(width)]
    meta = build_attention_metadata(query_lens, context_lens, [table] * len(query_lens),
                                    block_size, device)
    num_tokens = sum(query_lens)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(c - q, c, device=device)
                           for q, c in zip(query_lens, context_lens)])
    rows = torch.arange(num_tokens - num_logits, num_tokens, device=device)
    with torch.inference_mode():
        logits = model(ids, positions, kv_cache, meta, rows)
        # The sampler's working set: a sort and a softmax of every logits row.
        logits.float().sort(dim=-1)
        logits.float().softmax(dim=-1)
    del kv_cache, logits
    synchronize(device)
