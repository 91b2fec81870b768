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
from engine.device import free_memory_bytes, synchronize, total_memory_bytes
from engine.kv_cache import KVCache, num_blocks_for_budget

GIB = 2**30
# KV cache size on CPU when no budget is given (1 GiB holds ~23k tokens of SmolLM2-135M in
# float32); on a GPU, --gpu-memory-utilization decides.
CPU_KV_MEMORY_BYTES = GIB


def num_kv_blocks(config: EngineConfig, model, dtype: torch.dtype, device: torch.device,
                  free_at_start: int | None) -> int:
    """KV blocks of the target model: given outright, from --kv-cache-memory, 1 GiB on CPU, or
    on a GPU the share of --gpu-memory-utilization that the weights and a profiled largest step
    leave. `free_at_start`: free accelerator memory before the model loaded (None on CPU)."""
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
                        min(scheduler.max_num_batched_tokens, model.arch.max_position_embeddings),
                        scheduler.max_num_seqs * (max_k + 1))
        budget = gpu_kv_cache_budget(total_memory_bytes(device), free_at_start,
                                     free_at_start - free_memory_bytes(device),
                                     cache.gpu_memory_utilization)
        if spec.speculative_method == "draft":
            # The draft's own KV pool has as many blocks, each no larger than the target's for
            # a draft smaller than the target: half the budget each.
            budget //= 2
    return num_blocks_for_budget(model.arch, cache.block_size, dtype, budget)


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
            f"raise it or lower --max-num-batched-tokens")
    return budget


def _round_down(fraction: float) -> float:
    return max(int(fraction * 100) / 100, 0.01)


def profile_forward(model, block_size: int, dtype: torch.dtype, device: torch.device,
                    num_tokens: int, num_logits: int) -> None:
    """Runs the largest step the scheduler can make (a prefill of `num_tokens`, logits at
    `num_logits` rows) over a throwaway KV cache, so that the allocator's peak includes it."""
    num_blocks = -(-num_tokens // block_size)
    kv_cache = KVCache(model.arch, num_blocks, block_size, dtype, device)
    meta = build_attention_metadata([num_tokens], [num_tokens], [list(range(num_blocks))],
                                    block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    rows = torch.arange(num_tokens - min(num_logits, num_tokens), num_tokens, device=device)
    with torch.inference_mode():
        logits = model(ids, positions, kv_cache, meta, rows)
        # The sampler's working set: a sort and a softmax of every logits row.
        logits.float().sort(dim=-1)
        logits.float().softmax(dim=-1)
    del kv_cache, logits
    synchronize(device)
