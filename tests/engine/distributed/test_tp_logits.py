"""Tensor parallelism at the model's level (issue 73): a tiny model of each family, sharded over
2 ranks (this process and a real follower process, gloo on localhost), gives the logits of the
unsharded model within float32's tolerance, through prefill chunks and decode steps on a paged
cache, and its greedy tokens; a shard laid out wrongly (one rank holding the other's piece)
does not."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.kv_cache import KVCache
from engine.distributed import shard
from engine.distributed.launch import Followers
from engine.models.loader import load_model
from tests.conftest import make_tiny_model
from tests.engine.test_models import FAMILIES, _run_paged

CPU = torch.device("cpu")
# Between them: GQA and MHA-like splits, untied (with q/k/v and o biases) and tied vocabularies,
# Phi-3's fused checkpoint, per-head norms with a head size not hidden / heads, experts beside a
# dense layer, sliding windows, Gemma's norms, soft-caps, scales and second rotation.
TP_FAMILIES = {name: FAMILIES[name] for name in (
    "llama-bias", "qwen3-qk-norm", "phi3-fused-checkpoint", "qwen3-moe-dense-layer", "gemma2",
    "gemma3")}
# One KV head for 2 ranks (replicated, each rank's query heads reading it), and an odd
# vocabulary (the last rank's piece is shorter).
TP_FAMILIES["one-kv-head-odd-vocabulary"] = ("llama", {"num_key_value_heads": 1,
                                                       "vocab_size": 255})


def _logits(folder, followers: Followers | None) -> tuple[torch.Tensor, list[int]]:
    """The model's logits over 40 tokens (prefill chunks, then decode steps: test_models.py),
    and its greedy continuation of the first 8 of them, 12 tokens, in a cache of its own."""
    model = load_model(str(folder), CPU, torch.float32, with_tokenizer=False,
                       shard=followers and followers.shard).model
    cache = KVCache(model.kv_arch, num_blocks=32, block_size=4, dtype=torch.float32, device=CPU)
    if followers is not None:
        followers.follow(model)
        followers.mirror.set_main_cache(cache)
    torch.manual_seed(1)
    token_ids = torch.randint(0, model.arch.vocab_size, (40,)).tolist()
    logits = _run_paged(model, token_ids, [7, 3, 12, 0, 25, 9, 30, 1, 17, 4, 22], cache,
                        chunks=[17, 5, 9] + [1] * 9)
    greedy = token_ids[:8]
    for _ in range(12):  # each step feeds the whole sequence again: the cache is rewritten
        step = _run_paged(model, greedy, [2, 5, 6, 8, 10], cache, chunks=[len(greedy)])
        greedy.append(int(step[-1].argmax()))
    return logits, greedy[8:]


def _sharded_logits(folder) -> tuple[torch.Tensor, list[int]]:
    config = EngineConfig.from_kwargs(model=str(folder), device="cpu", dtype="float32",
                                      tensor_parallel_size=2)
    followers = Followers(config, CPU)
    try:
        return _logits(folder, followers)
    finally:
        followers.close()


@pytest.mark.parametrize("family", list(TP_FAMILIES))
def test_two_ranks_give_one_ranks_logits(tmp_path, family):
    model_type, overrides = TP_FAMILIES[family]
    make_tiny_model(tmp_path, model_type, **overrides)
    expected, expected_greedy = _logits(tmp_path, None)
    got, greedy = _sharded_logits(tmp_path)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert greedy == expected_greedy


def _exchanged(function):
    """`function(..., rank, world)` as rank 1 calls it."""
    return lambda *args: function(*args[:-2], 1 - args[-2], args[-1])


# Negative controls: the comparison above fails when rank 0 (this process) takes the other
# rank's piece while the follower keeps its own: its attention heads (q/k/v rows, o columns and
# KV cache alike), or its slice of the MLP's gate/up rows.
@pytest.mark.parametrize("piece", ["head_shard", "gate_up_rows"])
def test_a_wrongly_laid_out_shard_fails(tmp_path, monkeypatch, piece):
    make_tiny_model(tmp_path, "llama")
    expected, _ = _logits(tmp_path, None)
    monkeypatch.setattr(shard, piece, _exchanged(getattr(shard, piece)))
    got, _ = _sharded_logits(tmp_path)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() > 1e-2


def _arch(**fields):
    """A LlamaArchitecture of a tiny Llama with `fields` changed (test_tp_shard.py)."""
    from dataclasses import replace

    from engine.models.architecture import LlamaArchitecture

    base = LlamaArchitecture(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        rope_theta=10000.0, rope_scaling=None)
    return replace(base, **fields)
