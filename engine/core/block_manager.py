"""KV block bookkeeping: free list, reference counts and the prefix cache. Plain Python, no torch.

A block holds the KV of `block_size` consecutive tokens of one request. A *full* block whose tokens
are all committed (computed and accepted) is hashed by its content and the hash of the block before
it, so two requests whose prompts share a prefix can point their block tables at the same blocks.

Invariants:
- a block is in exactly one of: in use (ref_count > 0), evictable (ref_count == 0 and hashed, kept
  in LRU order so its content can still be reused), or free (ref_count == 0, no hash);
- `hash_to_block` maps a content hash to the one block that holds it; blocks are never written after
  they are hashed, because only full committed blocks are hashed and a request only appends;
- a request holds the blocks of its table from `num_released_blocks` on. With a sliding-window
  model (`window`), the leading blocks that no later query can read are given back as the request
  advances; their table entries become RELEASED_BLOCK, a valid id that attention never reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.core.request import Request

# What a released block's table entry becomes: any valid block id would do, since no query's
# window reaches it (the CPU kernel skips it; torch paths gather it and mask it out).
RELEASED_BLOCK = 0


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Content hash of one full block, chained to its parent so equal blocks at different depths
    of different prefixes never collide."""
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def salt_hash(cache_salt: str) -> bytes:
    """The parent hash of a request's first block: requests with different salts (tenants)
    chain different hashes from the start, so they never share a cached block."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The most keys any layer of any model that reads these blocks attends to; None where
        # some layer reads them all (nothing is released).
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Taken from the right (the block freed last), so a freed block is the next one used: on
        # a CPU the cache is memory the OS maps at first write, and taking the longest-free block
        # walked each request onto pages never written (2,040 page faults a 128-token chat
        # request, its KV in cold pages, and the resident set growing to the whole budget).
        self.free_block_ids: deque[int] = deque(reversed(range(num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take: free ones plus evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_tokens(self, num_prompt_tokens: int, num_total_tokens: int, max_chunk: int,
                    speculative) -> int:
        """The most tokens of KV a request can hold at once. All of them, unless blocks behind
        a window are released: then the first prefill chunk holds itself, and a later step the
        window behind its first query, its new tokens (a chunk of at most `max_chunk`, or a
        decode with its drafts, `speculative` a SpeculativeConfig) and a partial block at each
        end."""
        if self.window is None:
            return num_total_tokens
        first_chunk = min(num_prompt_tokens, max_chunk) + self.block_size
        lookahead = speculative.num_speculative_tokens if speculative.enabled else 0
        later_step = max(min(num_prompt_tokens - max_chunk, max_chunk), lookahead + 1)
        later = self.window + later_step + 2 * self.block_size
        return min(num_total_tokens, max(first_chunk, later))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is always left out so the model computes logits for the last one.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        parent, block_ids = salt_hash(request.cache_salt), []
        for i in range(max_blocks):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.hash_to_block.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    # --------------------------------------------------------------- mutations
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_block_ids: list[int] | None = None) -> bool:
        """Grows the request's block table to hold its computed tokens plus `num_new_tokens`.

        `cached_block_ids` (only for a request that holds no blocks yet) are prefix-cache hits that
        become the head of its table. Returns False, changing nothing, when blocks are short.
        """
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        if not cached_block_ids and num_needed <= len(request.block_table):
            return True  # most decode steps: the table holds the new token already
        cached_block_ids = cached_block_ids or []
        assert not cached_block_ids or not request.block_table, "prefix hits only on admission"
        num_fresh = num_needed - len(request.block_table) - len(cached_block_ids)
        # Cached hits that sit in the evictable pool stop being available to fresh allocations.
        num_hits_evictable = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        if max(num_fresh, 0) > self.num_free_blocks - num_hits_evictable:
            return False
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
        if cached_block_ids:
            request.block_table.extend(cached_block_ids)
            request.block_hashes.extend(self.block_hash[b] for b in cached_block_ids)
        for _ in range(num_fresh):
            request.block_table.append(self._take_fresh_block())
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_prompt_tokens
        self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_committed_tokens: int) -> None:
        """Hashes the request's full blocks whose tokens are all committed, so others can share."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_committed_tokens // self.block_size, len(request.block_table))
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else \
                salt_hash(request.cache_salt)
            block_hash = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            request.block_hashes.append(block_hash)
            block_id = request.block_table[i]
            if block_hash not in self.hash_to_block and self.block_hash[block_id] is None:
                self.hash_to_block[block_hash] = block_id
                self.block_hash[block_id] = block_hash

    def release_behind_window(self, request: Request) -> None:
        """Gives back the leading blocks that no later query of the request can read. Its next
        query sits at position num_computed_tokens or later (rejected drafts are rolled back to
        there), and a query at p reads keys p - window + 1 to p."""
        if self.window is None:
            return
        first_read = request.num_computed_tokens - self.window + 1
        behind = min(max(first_read, 0) // self.block_size, len(request.block_table))
        for i in range(request.num_released_blocks, behind):
            self._release(request.block_table[i])
            request.block_table[i] = RELEASED_BLOCK
        request.num_released_blocks = max(request.num_released_blocks, behind)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Releases the blocks past the first `num_tokens` tokens (rolled-back positions)."""
        keep = self.num_blocks_for(num_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())
        del request.block_hashes[keep:]

    def free(self, request: Request) -> None:
        """Releases all of the request's blocks. Tail first, so the LRU evicts tails before heads."""
        for block_id in reversed(request.block_table[request.num_released_blocks:]):
            self._release(block_id)
        request.block_table.clear()
        request.block_hashes.clear()
        request.num_released_blocks = 0

    # ---------------------------------------------------------------- helpers
    def _take_fresh_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            del self.hash_to_block[self.block_hash[block_id]]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_block_ids.append(block_id)
