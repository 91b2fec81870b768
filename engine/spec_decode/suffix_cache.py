"""The global suffix cache: what finished requests generated, one trie per tenant partition,
bounded by a number of requests and a byte budget, oldest request evicted first.

Drafts drawn from another user's outputs are a side channel (acceptance shows in `usage` and in
timing), so each partition (a request's `cache_salt`: its API key and the salt it sent) has its
own trie and a request only ever matches its own partition's. `scope="global"` puts every
request in one partition.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.config import SUFFIX_CACHE_SCOPES
from engine.core.device import release_freed_host_memory
from engine.spec_decode.suffix_native import new_trie

SHARED_PARTITION = ""
GROWTH_TO_RELEASE = 1 << 20  # bytes: smaller growths leave too little behind to hand back


def max_new_nodes(length: int, max_depth: int) -> int:
    """The most nodes inserting `length` tokens can add: one per substring of up to max_depth
    tokens starting at each position, as if none were in the trie yet."""
    if length <= max_depth:
        return length * (length + 1) // 2
    return max_depth * (length - max_depth) + max_depth * (max_depth + 1) // 2


@dataclass
class SuffixCacheStats:
    num_requests: int = 0  # finished requests whose tokens are in the cache
    num_nodes: int = 0
    num_bytes: int = 0  # the tries as allocated plus the kept token arrays
    num_partitions: int = 0
    num_evictions: int = 0  # requests evicted since start


@dataclass(frozen=True)
class _Entry:
    partition: str
    token_ids: array  # what was inserted, to take it back on eviction


class GlobalSuffixCache:
    def __init__(self, max_depth: int, max_requests: int, max_bytes: int,
                 scope: str = "tenant"):
        if scope not in SUFFIX_CACHE_SCOPES:
            raise ValueError(f"--suffix-cache-scope must be one of "
                             f"{', '.join(SUFFIX_CACHE_SCOPES)}, got {scope!r}")
        self.max_depth, self.max_requests, self.max_bytes = max_depth, max_requests, max_bytes
        self.scope = scope
        self._tries: dict = {}  # partition -> trie
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._next_id = 0
        self._token_bytes = 0
        self._num_nodes = 0
        self._trie_bytes = 0
        self.num_evictions = 0

    def partition(self, cache_salt: str) -> str:
        return SHARED_PARTITION if self.scope == "global" else cache_salt

    def trie(self, cache_salt: str):
        """The trie a request with this salt may draft from (None: nothing cached for it)."""
        return self._tries.get(self.partition(cache_salt))

    def add(self, cache_salt: str, token_ids: list[int]) -> None:
        """Puts a finished request's tokens in its partition, evicting the oldest requests first
        where its trie would otherwise grow past the byte budget, and after it while over a
        bound. A sequence alone over the byte budget is not kept."""
        if not token_ids or self.max_requests == 0:
            return
        partition = self.partition(cache_salt)
        tokens = array("i", token_ids)
        self._make_room(partition, tokens)
        trie = self._trie_of(partition)
        nodes, size = trie.num_nodes, trie.num_bytes
        trie.insert(tokens)
        self._num_nodes += trie.num_nodes - nodes
        self._trie_bytes += trie.num_bytes - size
        if trie.num_bytes > size + GROWTH_TO_RELEASE:
            # A table or array was reallocated: malloc keeps the old one's pages resident in
            # the engine thread's arena (offline, 48 MB of RSS for a 38 MB cache; 43 MB with
            # this). A growth doubles, so this runs a few dozen times in a cache's life.
            release_freed_host_memory()
        self._token_bytes += tokens.itemsize * len(tokens)
        self._entries[self._next_id] = _Entry(partition, tokens)
        self._next_id += 1
        while self._entries and (len(self._entries) > self.max_requests
                                 or self.num_bytes > self.max_bytes):
            if len(self._entries) == 1 and self._rebuild(partition):
                continue  # the room its evicted predecessors left is given back: recheck
            self._evict_oldest()

    def _trie_of(self, partition: str):
        trie = self._tries.get(partition)
        if trie is None:
            trie = self._tries[partition] = new_trie(self.max_depth)
            self._num_nodes += trie.num_nodes
            self._trie_bytes += trie.num_bytes
        return trie

    def _make_room(self, partition: str, tokens: array) -> None:
        """Evicts the oldest requests until the partition's trie can take `tokens` within the
        byte budget: in the room that evictions free in it, or by growing. Evicting only after
        an insert let a trie double its tables past the budget, and the evictions that followed
        (which free slots but no allocation) ran until a rebuild halved the cache."""
        worst = max_new_nodes(len(tokens), self.max_depth)
        incoming = tokens.itemsize * len(tokens)
        while self._entries:
            trie = self._trie_of(partition)
            growth = trie.num_bytes_with(worst) - trie.num_bytes
            if self.num_bytes + incoming + growth <= self.max_bytes:
                return
            self._evict_oldest()

    def _rebuild(self, partition: str) -> bool:
        """Builds the partition's trie afresh from the requests it holds, when removals left
        more free slots than live nodes (a dict and the node lists keep their size after
        removals); whether it did. Amortized O(1) per removed node: a rebuild follows at least
        as many removals as the nodes it inserts."""
        trie = self._tries[partition]
        if trie.num_free_slots <= trie.num_nodes:
            return False
        fresh = new_trie(self.max_depth)
        for entry in self._entries.values():
            if entry.partition == partition:
                fresh.insert(entry.token_ids)
        self._tries[partition] = fresh
        self._num_nodes += fresh.num_nodes - trie.num_nodes
        self._trie_bytes += fresh.num_bytes - trie.num_bytes
        return True

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        trie = self._tries[entry.partition]
        nodes, size = trie.num_nodes, trie.num_bytes
        trie.remove(entry.token_ids)
        self._num_nodes -= nodes - trie.num_nodes
        self._trie_bytes -= size - trie.num_bytes
        self._token_bytes -= entry.token_ids.itemsize * len(entry.token_ids)
        self.num_evictions += 1
        if trie.num_nodes == 1:  # only its root: the partition holds nothing now
            del self._tries[entry.partition]
            self._num_nodes -= 1
            self._trie_bytes -= trie.num_bytes
        else:
            self._rebuild(entry.partition)

    @property
    def num_bytes(self) -> int:
        return self._trie_bytes + self._token_bytes

    def stats(self) -> SuffixCacheStats:
        return SuffixCacheStats(len(self._entries), self._num_nodes, self.num_bytes,
                                len(self._tries), self.num_evictions)
