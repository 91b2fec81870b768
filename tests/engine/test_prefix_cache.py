"""BlockManager's prefix cache: chained block hashes, blocks shared between requests, cached
blocks kept after free and evicted least recently freed first. Plain Python, no model."""

from __future__ import annotations

from engine.core.block_manager import BlockManager, hash_block
from tests.engine.test_block_manager import BLOCK_SIZE, check_partition, make_request, prefill


def test_two_requests_share_a_two_block_prefix():
    manager = BlockManager(8, BLOCK_SIZE)
    prefix = [11, 12, 13, 14, 21, 22, 23, 24]
    first, second = make_request(prefix + [1, 2], "a"), make_request(prefix + [3, 4], "b")
    prefill(manager, first)
    assert len(first.block_hashes) == 2  # the third block is partial: never hashed
    cached = manager.find_cached_prefix(second)
    assert cached == first.block_table[:2]
    prefill(manager, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert second.block_hashes == first.block_hashes
    assert manager.num_free_blocks == 8 - 4
    check_partition(manager, [first, second])


def test_at_least_one_token_is_left_to_compute():
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_request(range(8), "a")
    prefill(manager, first)
    assert manager.find_cached_prefix(make_request(range(8))) == first.block_table[:1]
    assert manager.find_cached_prefix(make_request(range(9))) == first.block_table[:2]
    assert manager.find_cached_prefix(make_request(range(4))) == []
    assert manager.find_cached_prefix(make_request(range(5))) == first.block_table[:1]


def test_a_changed_token_breaks_sharing_from_its_block_on():
    manager = BlockManager(8, BLOCK_SIZE)
    tokens = list(range(12))
    first = make_request(tokens + [99], "a")
    prefill(manager, first)
    assert manager.find_cached_prefix(make_request(tokens + [98])) == first.block_table[:3]
    changed = list(tokens)
    changed[5] = 1000  # block 1
    assert manager.find_cached_prefix(make_request(changed + [99])) == first.block_table[:1]
    changed[0] = 1000  # block 0 too: nothing shared, even though block 2 is equal
    assert manager.find_cached_prefix(make_request(changed + [99])) == []


def test_hashes_are_chained_to_the_block_before():
    block_x, block_y = [1, 2, 3, 4], [5, 6, 7, 8]
    assert hash_block(b"", block_y) != hash_block(hash_block(b"", block_x), block_y)
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_request(block_x + block_y + [0], "a")
    prefill(manager, first)
    assert manager.find_cached_prefix(make_request(block_y + block_x + [0])) == []
    # The same content twice in one prompt gives two distinct cached blocks.
    repeated = make_request(block_x + block_x + [0], "b")
    prefill(manager, repeated)
    assert repeated.block_table[0] == first.block_table[0]
    assert repeated.block_table[1] not in first.block_table
    assert manager.block_hash[repeated.block_table[1]] is not None
    hits = manager.find_cached_prefix(make_request(block_x + block_x + [5]))
    assert hits == repeated.block_table[:2]
    check_partition(manager, [first, repeated])


def test_freed_cached_blocks_stay_reusable():
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_request(range(9), "a")
    prefill(manager, first)
    held = list(first.block_table)
    manager.free(first)
    assert manager.num_free_blocks == 4 and manager.ref_counts == [0] * 4
    assert set(manager.evictable) == set(held[:2])
    second = make_request(list(range(8)) + [42, 43], "b")
    assert manager.find_cached_prefix(second) == held[:2]
    prefill(manager, second)
    assert second.block_table[:2] == held[:2]
    assert not manager.evictable and manager.num_free_blocks == 1
    check_partition(manager, [second])


def test_fresh_blocks_come_from_the_free_list_before_evicting():
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_request(range(8), "a")
    prefill(manager, first)
    a0, a1 = first.block_table
    manager.free(first)  # tail first: a1 is least recently used
    assert list(manager.evictable) == [a1, a0]
    other = make_request(range(100, 108), "b")
    assert manager.allocate(other, 8)  # two truly free blocks
    assert set(other.block_table).isdisjoint({a0, a1})
    assert manager.find_cached_prefix(make_request(range(9))) == [a0, a1]
    grower = make_request(range(200, 204), "c")
    assert manager.allocate(grower, 4)  # evicts a1, the LRU one
    assert grower.block_table == [a1] and manager.block_hash[a1] is None
    assert manager.find_cached_prefix(make_request(range(9))) == [a0]
    assert manager.allocate(make_request([7], "d"), 1)  # evicts a0
    assert manager.find_cached_prefix(make_request(range(9))) == []
    assert not manager.hash_to_block and not manager.evictable


def test_eviction_order_is_least_recently_freed_first():
    manager = BlockManager(4, BLOCK_SIZE)
    old, new = make_request([1, 1, 1, 1, 0], "a"), make_request([2] * 4 + [0], "b")
    prefill(manager, old)
    prefill(manager, new)
    old_block, new_block = old.block_table[0], new.block_table[0]
    manager.free(old)
    manager.free(new)
    # A hit moves old's block to the most recently used end.
    reuser = make_request([1, 1, 1, 1, 5], "c")
    prefill(manager, reuser)
    manager.free(reuser)
    taker = make_request(range(300, 312), "d")
    assert manager.allocate(taker, 12)  # two free blocks plus one eviction
    assert new_block in taker.block_table and old_block not in taker.block_table
    assert manager.find_cached_prefix(make_request([1, 1, 1, 1, 0])) == [old_block]
    assert manager.find_cached_prefix(make_request([2] * 4 + [0])) == []


def test_prefix_hits_in_the_evictable_pool_do_not_count_as_free():
    manager = BlockManager(3, BLOCK_SIZE)
    first = make_request(range(8), "a")
    prefill(manager, first)
    manager.free(first)  # 2 evictable, 1 free
    second = make_request(list(range(8)) + [9] * 5, "b")  # 13 tokens: 2 hits + 2 fresh
    cached = manager.find_cached_prefix(second)
    assert len(cached) == 2
    second.num_computed_tokens = 8
    evictable, refs = list(manager.evictable), list(manager.ref_counts)
    assert not manager.allocate(second, 5, cached)
    assert second.block_table == [] and second.block_hashes == []
    assert list(manager.evictable) == evictable and manager.ref_counts == refs
    assert manager.allocate(second, 4, cached)  # 2 hits + 1 fresh fits
    assert second.block_table[:2] == cached
    check_partition(manager, [second])


def test_only_full_committed_blocks_are_hashed():
    manager = BlockManager(8, BLOCK_SIZE)
    request = make_request(range(10))
    assert manager.allocate(request, 10)
    manager.cache_full_blocks(request, 3)
    assert request.block_hashes == [] and not manager.hash_to_block
    manager.cache_full_blocks(request, 7)
    assert len(request.block_hashes) == 1 and len(manager.hash_to_block) == 1
    manager.cache_full_blocks(request, 10)
    manager.cache_full_blocks(request, 10)  # idempotent
    assert len(request.block_hashes) == 2 and len(manager.hash_to_block) == 2
    assert request.block_hashes[1] == hash_block(request.block_hashes[0], [4, 5, 6, 7])


def test_duplicate_content_computed_twice_is_cached_once():
    manager = BlockManager(8, BLOCK_SIZE)
    first, second = make_request(range(5), "a"), make_request(range(5), "b")
    for request in (first, second):  # both admitted before either published its blocks
        assert manager.allocate(request, 5)
        request.num_computed_tokens = 5
    manager.cache_full_blocks(first, 5)
    manager.cache_full_blocks(second, 5)
    first_head = first.block_table[0]
    assert manager.hash_to_block == {first.block_hashes[0]: first.block_table[0]}
    assert second.block_hashes == first.block_hashes
    assert manager.block_hash[second.block_table[0]] is None
    manager.free(second)
    manager.free(first)
    assert list(manager.evictable) == [first_head] and manager.num_free_blocks == 8
    check_partition(manager, [])


def test_truncate_frees_blocks_past_the_kept_tokens():
    manager = BlockManager(8, BLOCK_SIZE)
    request = make_request(range(11))
    assert manager.allocate(request, 11)
    request.num_computed_tokens = 8
    manager.cache_full_blocks(request, 8)
    b0, b1, b2 = request.block_table
    manager.truncate(request, 9)
    assert request.block_table == [b0, b1, b2]
    manager.truncate(request, 8)
    assert request.block_table == [b0, b1] and manager.ref_counts[b2] == 0
    assert b2 in manager.free_block_ids and len(request.block_hashes) == 2
    manager.truncate(request, 5)
    assert request.block_table == [b0, b1] and len(request.block_hashes) == 2
    assert manager.num_free_blocks == 6
    check_partition(manager, [request])


def test_prefix_stats_accumulate():
    manager = BlockManager(4, BLOCK_SIZE)
    manager.record_prefix_lookup(10, 0)
    manager.record_prefix_lookup(12, 8)
    assert (manager.prefix_stats.queries, manager.prefix_stats.hits) == (22, 8)


def test_prefix_caching_disabled_shares_nothing():
    manager = BlockManager(4, BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request(range(9), "a")
    prefill(manager, first)
    assert first.block_hashes == [] and not manager.hash_to_block
    assert manager.find_cached_prefix(make_request(range(9))) == []
    manager.free(first)
    assert not manager.evictable and len(manager.free_block_ids) == 4


def test_requests_with_different_cache_salts_share_no_block():
    manager = BlockManager(16, BLOCK_SIZE)
    prefix = [11, 12, 13, 14, 21, 22, 23, 24]
    alice = make_request(prefix + [1, 2], "a")
    alice.cache_salt = "alice"
    prefill(manager, alice)
    bob, alice_again = make_request(prefix + [3], "b"), make_request(prefix + [3], "c")
    bob.cache_salt, alice_again.cache_salt = "bob", "alice"
    assert manager.find_cached_prefix(bob) == []
    assert manager.find_cached_prefix(make_request(prefix + [3], "d")) == []  # no salt either
    # the negative control: the same salt does share
    assert manager.find_cached_prefix(alice_again) == alice.block_table[:2]
