"""Tests of BlockManager's allocation: free list, reference counts, growing and freeing block
tables. The prefix cache (hashes, sharing, eviction): test_prefix_cache.py. Plain Python."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(token_ids: Iterable[int], request_id: str = "r") -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def prefill(manager: BlockManager, request: Request) -> None:
    """What the scheduler does for a whole prompt in one step: reserve (reusing cached prefix
    blocks), compute, then publish the full committed blocks."""
    cached = manager.find_cached_prefix(request)
    request.num_computed_tokens = len(cached) * manager.block_size
    num_new = request.num_tokens - request.num_computed_tokens
    assert manager.allocate(request, num_new, cached)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, request.num_computed_tokens)


def check_partition(manager: BlockManager, holders: list[Request]) -> None:
    """Each block is exactly one of in use / evictable / free, and ref counts match the tables."""
    expected = [0] * manager.num_blocks
    for request in holders:
        for block_id in request.block_table:
            expected[block_id] += 1
    assert manager.ref_counts == expected
    free, evictable = set(manager.free_block_ids), set(manager.evictable)
    assert len(free) == len(manager.free_block_ids) and not free & evictable
    in_use = {b for b in range(manager.num_blocks) if expected[b] > 0}
    assert free | evictable | in_use == set(range(manager.num_blocks))
    assert not in_use & (free | evictable)
    assert all(manager.block_hash[b] is None for b in free)
    assert all(manager.block_hash[b] is not None for b in evictable)
    assert {b: h for h, b in manager.hash_to_block.items()} == {
        b: h for b, h in enumerate(manager.block_hash) if h is not None}


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 9, 16])
def test_allocate_takes_ceil_tokens_over_block_size(num_tokens):
    manager = BlockManager(8, BLOCK_SIZE)
    request = make_request(range(num_tokens))
    assert manager.allocate(request, num_tokens)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    assert len(request.block_table) == num_blocks == manager.num_blocks_for(num_tokens)
    assert len(set(request.block_table)) == num_blocks
    assert manager.num_free_blocks == 8 - num_blocks
    assert manager.usage == pytest.approx(num_blocks / 8)
    check_partition(manager, [request])


def test_allocate_grows_the_table_incrementally():
    manager = BlockManager(8, BLOCK_SIZE)
    request = make_request(range(20))
    table_sizes = []
    for num_new in [3, 1, 1, 3, 4, 1]:  # computed before each: 0, 3, 4, 5, 8, 12
        assert manager.allocate(request, num_new)
        request.num_computed_tokens += num_new
        table_sizes.append(len(request.block_table))
    assert table_sizes == [1, 1, 2, 2, 3, 4]
    assert manager.num_free_blocks == 4
    check_partition(manager, [request])


def test_allocate_when_short_returns_false_and_changes_nothing():
    manager = BlockManager(3, BLOCK_SIZE)
    first, second = make_request(range(8), "a"), make_request(range(100, 108), "b")
    assert manager.allocate(first, 8)
    refs, free = list(manager.ref_counts), list(manager.free_block_ids)
    assert not manager.allocate(second, 5)  # needs 2, one left
    assert second.block_table == [] and second.block_hashes == []
    assert manager.ref_counts == refs and list(manager.free_block_ids) == free
    assert manager.allocate(second, 4)  # exactly the one left
    assert manager.num_free_blocks == 0
    assert not manager.allocate(make_request([7], "c"), 1)
    check_partition(manager, [first, second])


def test_free_returns_every_block():
    manager = BlockManager(10, BLOCK_SIZE)
    shared = list(range(8))
    requests = [make_request(shared + [50 + i] * (i + 1), f"r{i}") for i in range(3)]
    for request in requests:
        prefill(manager, request)
    check_partition(manager, requests)
    assert manager.ref_counts[requests[0].block_table[0]] == 3
    for request in requests:
        manager.free(request)
        assert request.block_table == [] and request.block_hashes == []
    assert manager.num_free_blocks == 10 and manager.usage == 0.0
    assert manager.ref_counts == [0] * 10
    check_partition(manager, [])
