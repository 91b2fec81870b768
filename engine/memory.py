"""How much accelerator memory the KV cache gets, the way vLLM sizes it.

`--gpu-memory-utilization F` is the share of the card's *total* memory this server may hold:
weights, the peak activations of the largest step (measured by a profiling forward), and the KV
cache, which gets the rest. Other processes' memory is not ours to spend: when the card has less
free than F asks for, the server refuses to start with one line saying what to pass.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import build_attention_metadata
from engine.device import synchronize
from engine.kv_cache import KVCache

GIB = 2**30


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
