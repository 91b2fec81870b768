"""KV cache sizing on a GPU: --gpu-memory-utilization is a share of the card's total memory."""

from __future__ import annotations

import pytest
import torch

from engine.core.memory import GIB, gpu_kv_cache_budget, profile_forward
from tests.conftest import make_llm


def test_the_kv_cache_gets_what_the_weights_and_activations_leave():
    budget = gpu_kv_cache_budget(total=80 * GIB, free_at_start=79 * GIB, used_by_us=2 * GIB,
                                 utilization=0.9)
    assert budget == int(80 * GIB * 0.9) - 2 * GIB


def test_a_busy_card_is_refused_with_what_to_pass():
    # A second server on a card where the first holds 72 GiB.
    with pytest.raises(ValueError) as error:
        gpu_kv_cache_budget(total=80 * GIB, free_at_start=8 * GIB, used_by_us=0, utilization=0.9)
    message = str(error.value)
    assert "\n" not in message
    assert "only 8.0 GiB are free" in message
    suggested = float(message.rsplit("--gpu-memory-utilization ", 1)[1].split()[0])
    assert 0 < suggested * 80 <= 8  # what it suggests fits in what is free
    gpu_kv_cache_budget(total=80 * GIB, free_at_start=8 * GIB, used_by_us=GIB,
                        utilization=suggested)


def test_weights_larger_than_the_share_are_refused():
    with pytest.raises(ValueError, match="raise it, or lower --max-num-batched-tokens"):
        gpu_kv_cache_budget(total=16 * GIB, free_at_start=16 * GIB, used_by_us=15 * GIB,
                            utilization=0.5)


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_the_flag_is_validated(value):
    from engine.config import CacheConfig

    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        CacheConfig(gpu_memory_utilization=value)


def test_the_profile_runs_the_widest_prefill_and_decode_steps(tiny_chat_model_folder):
    """What the KV cache must leave room for: a prefill chunk whose attention reads a whole
    max_model_len context, and max_num_seqs verify queries each reading max_model_len keys (the
    torch backend gathers them all). Both run, whatever the device, over a throwaway cache."""
    llm = make_llm(str(tiny_chat_model_folder), speculative_method="none")
    model, device = llm.engine.runner.model, llm.engine.device
    steps = []
    forward = model.forward

    def spy(ids, positions, kv_cache, meta, rows):
        steps.append((ids.numel(), positions.max().item(), meta, rows.numel(),
                      kv_cache[0][0].shape[0]))
        return forward(ids, positions, kv_cache, meta, rows)

    model.forward = spy
    profile_forward(model, 16, torch.float32, device, num_tokens=64, num_logits=24,
                    max_num_seqs=6, max_query_len=4, max_model_len=200)
    (prefill, last_prefill, prefill_meta, prefill_logits, cache_blocks), \
        (decode, last_decode, decode_meta, decode_logits, _) = steps
    assert (prefill, last_prefill, prefill_logits) == (64, 199, 24)
    assert [c.context_len for c in prefill_meta.chunks] == [200]
    assert cache_blocks < 200 // 16  # the cache is a throwaway few blocks
    assert (decode, last_decode, decode_logits) == (24, 199, 24)
    batched = decode_meta.batched
    assert batched.num_seqs == 6 and batched.block_tables.shape == (6, 13)
    assert batched.context_lens.tolist() == [200] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_stays_within_its_share(tiny_chat_model_folder):
    from engine import LLM

    _free, total = torch.cuda.mem_get_info()
    before = torch.cuda.memory_reserved()
    llm = LLM(str(tiny_chat_model_folder), device="cuda", gpu_memory_utilization=0.3,
              speculative_method="none")
    llm.generate("hello", None)
    assert torch.cuda.memory_reserved() - before <= 0.3 * total
    assert llm.engine.limits.num_kv_blocks > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_engine_made_after_another_is_dropped_gets_the_same_share(tiny_chat_model_folder):
    """The allocator keeps a dropped engine's memory cached; counted as taken, it would make the
    next engine in the process be refused (0.6 + 0.6 of the card)."""
    from engine import LLM

    options = dict(device="cuda", gpu_memory_utilization=0.6, speculative_method="none",
                   enforce_eager=True)
    first = LLM(str(tiny_chat_model_folder), **options)
    blocks = first.engine.limits.num_kv_blocks
    del first
    second = LLM(str(tiny_chat_model_folder), **options)
    assert second.engine.limits.num_kv_blocks >= 0.9 * blocks


_FREED_PAGES_PROBE = """
import os, sys
from engine.core.device import release_freed_host_memory

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

release = sys.argv[1] == "release"
before = resident()
blocks = [bytearray(100_000) for _ in range(600)]  # below the mmap threshold: heap pages
pin = blocks[-1]  # the last block pins the heap's top, as a long-lived tensor does after loading
del blocks
freed = resident()
if release:
    release_freed_host_memory()
print(before, freed, resident())
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
@pytest.mark.parametrize("release", [True, False])
def test_freed_host_memory_goes_back_to_the_os(release):
    """60 MB freed inside the heap stays resident until `release_freed_host_memory`, and only
    then goes back (the negative control: it stays without the call). In a fresh interpreter:
    in the test process, free heap left by earlier tests absorbed the 60 MB without new pages."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", _FREED_PAGES_PROBE,
                            "release" if release else "keep"],
                           capture_output=True, text=True, check=True, timeout=120)
    before, freed, after = map(int, probe.stdout.split())
    assert freed > before + 40_000_000  # freed, yet nothing gave them back
    if release:
        assert after < freed - 40_000_000
    else:
        assert after > freed - 10_000_000
