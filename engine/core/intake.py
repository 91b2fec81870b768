"""What a request must satisfy before it is queued: errors phrased for an API client."""

from __future__ import annotations

from engine.config import EngineConfig, EngineLimits
from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams


def check_prompt_ids(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_fits(token_ids: list[int], params: SamplingParams, limits: EngineLimits,
               block_manager: BlockManager, config: EngineConfig) -> None:
    """Raises ValueError where the prompt is empty, prompt plus max_tokens pass the context
    limit, or the request could never hold its KV in the whole cache."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    total = len(token_ids) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"this model's maximum context length is {limits.max_model_len} tokens, but the "
            f"prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens} "
            f"({total} in all)")
    capacity = limits.num_kv_blocks * limits.block_size
    need = block_manager.peak_tokens(len(token_ids), total,
                                     config.scheduler.max_num_batched_tokens, config.speculative)
    if need > capacity:
        raise ValueError(f"the request needs {need} tokens of KV cache but the whole cache "
                         f"holds {capacity}; raise --kv-cache-memory or lower max_tokens")
