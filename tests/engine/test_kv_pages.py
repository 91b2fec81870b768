"""The CPU KV cache is resident only where blocks hold something: pages are handed out as they are
written, and the start-up cost probe hands the ones it wrote back (engine/core/kv_cache.py)."""

from __future__ import annotations

import ctypes
import mmap
from types import SimpleNamespace

import torch

from engine.core.kv_cache import KVCache
from tests.conftest import make_llm

MIB = 2**20


def resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the pages under `tensor` (mincore(2); /proc/self/smaps would not do:
    the kernel merges neighbouring anonymous mappings into one entry)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    num_pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    pages = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(start, num_pages * page, pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(flag & 1 for flag in pages) * page


def _cache(num_blocks: int = 256) -> KVCache:
    arch = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=64)  # what KVCache reads
    return KVCache(arch, num_blocks, 16, torch.float32, torch.device("cpu"))  # 16 MiB


def test_written_blocks_are_resident_until_released():
    cache = _cache()
    assert resident_bytes(cache.storage) == 0  # reserved, not touched
    keys, values = cache[0]
    keys[:128].fill_(1.0)  # half the blocks of one layer's keys: 1 MiB
    values[:128].fill_(2.0)
    touched = resident_bytes(cache.storage)
    assert touched >= 2 * MIB, touched  # the negative control: written pages stay resident
    assert resident_bytes(cache.storage) == touched
    cache.release_pages()
    assert resident_bytes(cache.storage) == 0
    assert not cache.storage.any()  # released pages read as zeros
    keys[0].fill_(3.0)  # and can be written again
    assert keys[0].eq(3.0).all() and resident_bytes(cache.storage) > 0


def test_the_start_up_probe_leaves_no_block_resident(tiny_chat_model_folder, monkeypatch):
    """`ngram` times forwards at start (cost_probe.py) into the cache's first blocks; after it the
    cache holds no resident page. Negative control: without the release, the probe's writes
    stay resident."""
    llm = make_llm(str(tiny_chat_model_folder), speculative_method="ngram")
    assert resident_bytes(llm.engine.runner.kv_cache.storage) == 0
    del llm
    monkeypatch.setattr(KVCache, "release_pages", lambda self: None)
    kept = make_llm(str(tiny_chat_model_folder), speculative_method="ngram")
    assert resident_bytes(kept.engine.runner.kv_cache.storage) > 0


def _resident_after_requests(folder, take_longest_free: bool, monkeypatch) -> list[int]:
    """The KV cache's resident bytes after each of 6 requests served one after another."""
    from engine import SamplingParams
    from engine.core.block_manager import BlockManager

    if take_longest_free:  # the old order: the block freed longest ago (a FIFO free list)
        pop_right = BlockManager._take_fresh_block

        def take_left(self):
            self.free_block_ids.rotate(-1)  # the left end moves to the right, where pop() takes
            return pop_right(self)
        monkeypatch.setattr(BlockManager, "_take_fresh_block", take_left)
    llm = make_llm(str(folder), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    resident = []
    for i in range(6):
        llm.generate([list(range(10 + i, 90 + i))], params)
        resident.append(resident_bytes(llm.engine.runner.kv_cache.storage))
    return resident


def test_requests_one_after_another_reuse_the_same_pages(tiny_chat_model_folder, monkeypatch):
    """A freed block is the next one taken, so sequential requests write the pages the first
    one made resident, not new ones (no page faults, warm pages, a resident set of one
    request's KV). Negative control: taking the block freed longest ago, each request lands on
    untouched pages and the resident KV grows with every request."""
    reused = _resident_after_requests(tiny_chat_model_folder, False, monkeypatch)
    assert reused[0] > 0 and all(r == reused[0] for r in reused), reused
    walked = _resident_after_requests(tiny_chat_model_folder, True, monkeypatch)
    assert all(b > a for a, b in zip(walked, walked[1:])), walked


def _after_filling_the_cache(folder, prefix_caching: bool) -> tuple[list, list]:
    """Two requests' tokens on a fresh engine, then the same requests after every byte of the
    KV cache was overwritten with NaN."""
    from engine import SamplingParams

    llm = make_llm(str(folder), enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(10, 90)), list(range(200, 237))]
    before = [output.token_ids for output in llm.generate(prompts, params)]
    llm.engine.runner.kv_cache.storage.fill_(float("nan"))
    after = [output.token_ids for output in llm.generate(prompts, params)]
    return before, after


def test_what_free_blocks_hold_never_reaches_a_request(tiny_chat_model_folder):
    """Blocks are reused as they were left (the freed block is the next one taken), so nothing
    a request computes may read a slot it has not written: a cache filled with NaN between two
    runs gives the same tokens. Negative control: with prefix caching the second run reads the
    first run's cached blocks, and the NaN in them changes what it computes."""
    before, after = _after_filling_the_cache(tiny_chat_model_folder, prefix_caching=False)
    assert after == before
    cached_before, cached_after = _after_filling_the_cache(tiny_chat_model_folder,
                                                           prefix_caching=True)
    assert cached_before == before and cached_after != cached_before
