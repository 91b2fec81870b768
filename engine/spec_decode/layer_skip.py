"""Choosing which of the target's layers a layer-skip draft runs.

Early exit (the first N layers) is useless on small models: on SmolLM2-135M the first 6 or 10 of
30 layers agree with the full model on < 1% of tokens. So any set may be skipped. The search,
teacher-forced on sample text (one prefill per candidate, no generation):
1. rank the middle layers by how little skipping each one alone changes the model's predictions
   (the first and last layers are always kept);
2. for each candidate depth n, skip the L - n least important layers and measure the agreement a
   with the full model's next-token choices;
3. predict tokens/s for each (n, K) from the cost model: (1 - a^(K+1)) / (1 - a) tokens per
   (K draft steps of n/L of a forward, plus one verify of K + 1 tokens), against plain decoding,
   and keep the best. The result is cached per model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SAMPLE_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe.",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
    "        middle = (low + high) // 2\n        if items[middle] == target:\n"
    "            return middle\n        if items[middle] < target:\n            low = middle + 1\n"
    "        else:\n            high = middle - 1\n    return -1\n",
    "<|im_start|>user\nWhat are three tips for staying focused while studying?<|im_end|>\n"
    "<|im_start|>assistant\n1. Put your phone in another room. 2. Work in short, timed sessions "
    "with breaks. 3. Write down one clear goal before you start.<|im_end|>",
]


@dataclass
class LayerSkipChoice:
    layer_ids: list[int]
    agreement: float  # share of positions where the draft's argmax equals the target's
    num_speculative_tokens: int
    predicted_speedup: float  # vs plain decoding, from the cost model


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens per verify step with K drafts accepted independently with probability a."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def choose_layers(model: LlamaForCausalLM, tokenizer, max_k: int, step_cost,
                  num_layers: int | None = None, cache_file: Path | None = None
                  ) -> LayerSkipChoice:
    """Runs (or reads from `cache_file`) the search above. `num_layers` fixes the depth."""
    if cache_file is not None and cache_file.is_file():
        return LayerSkipChoice(**json.loads(cache_file.read_text()))
    total = model.arch.num_layers
    token_ids = [t for text in SAMPLE_TEXTS for t in tokenizer(text)["input_ids"]]
    full = _argmax_predictions(model, token_ids, None)
    middle = list(range(1, total - 1))
    harm = {layer: 1 - _agreement(model, token_ids, [l for l in range(total) if l != layer], full)
            for layer in middle}
    least_important_first = sorted(middle, key=lambda layer: harm[layer])
    depths = [num_layers] if num_layers else sorted({max(2, round(total * f))
                                                     for f in (0.25, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)})
    plain_seconds = step_cost(1)
    best = None
    for depth in depths:
        skipped = set(least_important_first[:max(total - depth, 0)])
        layer_ids = [l for l in range(total) if l not in skipped]
        agreement = _agreement(model, token_ids, layer_ids, full)
        draft_step = plain_seconds * len(layer_ids) / total
        for k in range(1, max_k + 1):
            seconds_per_step = k * draft_step + step_cost(k + 1)
            speedup = expected_tokens(agreement, k) * plain_seconds / seconds_per_step
            if best is None or speedup > best.predicted_speedup:
                best = LayerSkipChoice(layer_ids, agreement, k, speedup)
    logger.info("layer-skip: %d of %d layers agree on %.1f%% of tokens; predicted speedup %.2fx "
                "at K=%d", len(best.layer_ids), total, 100 * best.agreement,
                best.predicted_speedup, best.num_speculative_tokens)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(asdict(best)))
    return best


def calibration_cache_file(cache_root: Path, model_folder: Path, max_k: int,
                           num_layers: int | None) -> Path:
    key = hashlib.sha256(f"{model_folder.resolve()}:{max_k}:{num_layers}".encode()).hexdigest()
    return cache_root / "layer_skip" / f"{key[:16]}.json"


def _agreement(model, token_ids, layer_ids, full_predictions) -> float:
    predictions = _argmax_predictions(model, token_ids, layer_ids)
    return (predictions == full_predictions).float().mean().item()


def _argmax_predictions(model, token_ids, layer_ids) -> torch.Tensor:  # [num_tokens]
    """Teacher-forced next-token choices over `token_ids`, in a scratch KV cache."""
    device = model.lm_head.weight.device
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    cache = KVCache(model.kv_arch, num_blocks, block_size, model.norm.weight.dtype, device)
    n = len(token_ids)
    meta = build_attention_metadata([n], [n], [list(range(num_blocks))], block_size, device)
    logits = model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), cache,
                   meta, torch.arange(n, device=device), layer_ids=layer_ids)
    return logits.argmax(dim=-1)
