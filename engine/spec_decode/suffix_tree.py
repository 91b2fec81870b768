"""A count trie over every substring (up to `max_depth` tokens) of the sequences put into it: the
suffix structure of SuffixDecoding (Oliaro et al., arXiv 2411.04975), truncated at a depth.

A node stands for one substring; its `count` is how many times that substring occurs in the
sequences inserted (each start position counts once). A child's count over its parent's is the
empirical probability that the substring continues with the child's token, which is what a draft
is chosen by.

Every substring of an inserted substring is inserted too, so the suffixes of a context that
occur in the trie are exactly those up to some length M: a `Matcher` keeps the nodes of the
context's suffixes of lengths 1..M and advances them by each appended token in O(M) dict lookups,
whatever the context's length. A sequence is inserted (and removed) the same way: O(length x
max_depth).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Nodes are ints indexing flat lists, and edges one dict of ints keyed by node * EDGE_STRIDE +
# token: a trie of a million nodes as Python objects made the cyclic garbage collector walk all
# of them (136 ms stalls inside a step), while a dict of ints is not tracked by it at all.
EDGE_STRIDE = 1 << 24  # above any vocabulary size
ROOT = 0
NO_CHILD = -1
# Bytes of the int objects one live node adds beside the containers: its edge's key (> 2**30, 36
# bytes allocated) and its id (32; shared by the edge's value and its parent's best slot).
NODE_INT_BYTES = 68
FREE_ID_BYTES = 32  # the int object of a freed node's id, held by the free list
# What a node past the freed ids costs on average, with the containers' growth spread over it
# (measured: ~139 bytes a node on 480,000 nodes); CPython grows its dict and lists by its own
# rules, so `num_bytes_with` is an estimate here, where the C++ trie's is exact.
NODE_BYTES_ESTIMATE = 140


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1 us, twice a step
class Draft:
    token_ids: list[int]
    score: float  # expected accepted tokens: the sum of the drafts' path probabilities
    match_length: int
    path_probability: float = 1.0  # of the whole chain: the product of its count ratios
    # The same product with one unseen alternative at every step, child / (parent + 1): a path
    # seen once is a coin flip, not a certainty (see `prior_acceptance`).
    smoothed_probability: float = 1.0

    @property
    def prior_acceptance(self) -> float:
        """What the chain promises per token, in the controller's terms: the geometric mean of
        its smoothed count ratios. Raw ratios made every path seen once look certain, and at 16
        concurrent requests the controller then verified so many of them that templated
        traffic ran at 0.93x `none`; smoothed, a path seen once starts at the default prior
        (0.5), one seen 8 times at 0.89."""
        return self.smoothed_probability ** (1 / len(self.token_ids))


def check_max_depth(max_depth: int) -> None:
    """Both tries' one rule on their depth (the C++ one is checked here, before it is built)."""
    if max_depth < 2:
        raise ValueError(f"--suffix-max-depth must be >= 2, got {max_depth}")


class SuffixTrie:
    def __init__(self, max_depth: int):
        check_max_depth(max_depth)
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # node * EDGE_STRIDE + token -> child
        self.counts: list[int] = [0]  # per node: occurrences of its substring
        # Per node: its child with the highest count, NO_CHILD where it has none (or, after a
        # removal dropped that child, none known until an insertion passes). Kept up on
        # increments, so a draft step is O(1), not O(children); after removals it may name a
        # child no longer the likeliest, which costs acceptance, never correctness.
        self.best: list[int] = [NO_CHILD]
        self.tokens = array("i", [0])  # per node: the token on the edge into it
        self._free: list[int] = []  # node ids removal gave back
        # Bumped by every insertion and removal: a match made on an older version may miss a
        # longer suffix, or hold nodes a removal dropped, and is made afresh.
        self.version = 0

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        """What the trie holds in memory, in O(1): the containers as allocated (a dict keeps
        its size after removals, lists their slots for freed ids) and the live nodes' ints.
        Within a few percent of tracemalloc's count (tests/engine/spec_decode/test_suffix.py)."""
        return (sys.getsizeof(self.edges) + sys.getsizeof(self.counts)
                + sys.getsizeof(self.best) + sys.getsizeof(self.tokens)
                + sys.getsizeof(self._free) + self.num_nodes * NODE_INT_BYTES
                + self.num_free_slots * FREE_ID_BYTES)

    # The interface both tries share (suffix_native.py's C++ one has the same methods).
    def extend_all(self, active: list[int], token_ids: Iterable[int]) -> list[int]:
        for token_id in token_ids:
            active = self.extend(active, token_id)
        return active

    def advance_all(self, matched: list[int], token_ids: Iterable[int]) -> list[int]:
        for token_id in token_ids:
            matched = advance(self, matched, token_id)
        return matched

    def match(self, token_ids: Sequence[int]) -> list[int]:
        return match(self, token_ids)

    def draft(self, matched: Sequence[int], tail: Sequence[int], num_tokens: int,
              max_spec_factor: float, min_token_prob: float) -> Draft | None:
        return draft_from(self, matched, tail, num_tokens, max_spec_factor, min_token_prob)

    def count(self, node: int) -> int:
        return self.counts[node]

    def edge_list(self) -> list[tuple[int, int, int]]:
        """(parent, token, child) of every edge."""
        return [(key // EDGE_STRIDE, key % EDGE_STRIDE, child)
                for key, child in self.edges.items()]

    def num_bytes_with(self, more: int) -> int:
        """About `num_bytes` once `more` nodes were added (see NODE_BYTES_ESTIMATE)."""
        return self.num_bytes + max(more - len(self._free), 0) * NODE_BYTES_ESTIMATE

    def _new_node(self, token_id: int) -> int:
        if self._free:
            node = self._free.pop()
            self.tokens[node] = token_id
            return node
        self.counts.append(0)
        self.best.append(NO_CHILD)
        self.tokens.append(token_id)
        return len(self.counts) - 1

    def extend(self, active: list[int], token_id: int) -> list[int]:
        """Inserts one token after the suffixes `active` (the nodes of the current substrings,
        shortest first); returns the nodes of the substrings that end at it."""
        edges, counts, best = self.edges, self.counts, self.best
        extended = []
        if len(active) >= self.max_depth:
            active = active[:self.max_depth - 1]
        for node in (ROOT, *active):
            key = node * EDGE_STRIDE + token_id
            child = edges.get(key)
            if child is None:
                child = edges[key] = self._new_node(token_id)
            counts[child] += 1
            known = best[node]
            if known < 0 or (known != child and counts[child] > counts[known]):
                best[node] = child
            extended.append(child)
        return extended

    def insert(self, token_ids: Iterable[int]) -> None:
        self.version += 1
        self.extend_all([], token_ids)

    def remove(self, token_ids: Sequence[int]) -> None:
        """Takes back one earlier `insert(token_ids)`. A child whose count falls to 0 goes with
        its subtree: counts never grow with depth, so all of that subtree counted only the
        occurrence removed, a chain along its remaining tokens."""
        self.version += 1
        edges, counts, best = self.edges, self.counts, self.best
        length = len(token_ids)
        for start in range(length):
            node = ROOT
            end = min(start + self.max_depth, length)
            for position in range(start, end):
                key = node * EDGE_STRIDE + token_ids[position]
                child = edges[key]
                counts[child] -= 1
                if counts[child] == 0:
                    del edges[key]
                    if best[node] == child:
                        best[node] = NO_CHILD
                    self._drop_chain(child, token_ids[position + 1:end])
                    break
                node = child

    def _drop_chain(self, node: int, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            child = self.edges.pop(node * EDGE_STRIDE + token_id)
            self._release(node)
            node = child
        self._release(node)

    def _release(self, node: int) -> None:
        self.counts[node] = 0
        self.best[node] = NO_CHILD
        self._free.append(node)


def advance(trie: SuffixTrie, matched: list[int], token_id: int) -> list[int]:
    """The nodes of the suffixes that end at `token_id` after those of `matched` (shortest
    first), without inserting anything. Stops at the first suffix the trie lacks: no longer
    one can be there."""
    edges = trie.edges
    advanced = []
    for node in (ROOT, *matched[:trie.max_depth - 1]):
        child = edges.get(node * EDGE_STRIDE + token_id)
        if child is None:
            break
        advanced.append(child)
    return advanced


def match(trie: SuffixTrie, token_ids: Sequence[int]) -> list[int]:
    """`advance` over the last max_depth - 1 tokens: O(max_depth^2) lookups, for a fresh start."""
    matched: list[int] = []
    for token_id in token_ids[max(len(token_ids) - (trie.max_depth - 1), 0):]:
        matched = advance(trie, matched, token_id)
    return matched


def draft_from(trie: SuffixTrie, matched: Sequence[int], tail: Sequence[int], num_tokens: int,
               max_spec_factor: float, min_token_prob: float) -> Draft | None:
    """The chain of likeliest continuations of the longest matched suffix that has any, `tail`
    being the context's last tokens (at least the max_depth - 1 that `matched` ends with). A match
    of length m drafts at most max_spec_factor * m tokens (short matches guess badly), and a
    draft stops where its path probability (the product of count ratios) falls below
    min_token_prob. Where the chain reaches the end of what the trie holds (its depth), it goes
    on from a shorter suffix of context and draft (`_reanchor`), so a long copy drafts past
    max_depth."""
    best, counts, tokens = trie.best, trie.counts, trie.tokens
    for length in range(len(matched), 0, -1):
        node = matched[length - 1]
        if best[node] >= 0:
            break
    else:
        return None
    limit = min(num_tokens, max(1, int(max_spec_factor * length)))
    token_ids: list[int] = []
    probability, smoothed, score = 1.0, 1.0, 0.0
    depth = length  # of `node`'s substring
    while len(token_ids) < limit:
        child = best[node]
        if child < 0:
            if depth < trie.max_depth:
                break  # nothing ever followed this substring
            # The deepest substring the trie holds: shorten the context, go on.
            node, depth = _reanchor(trie, tail, token_ids)
            if node < 0:
                break
            child = best[node]
        extended = probability * counts[child] / counts[node]
        if extended < min_token_prob:
            break
        probability = extended
        smoothed *= counts[child] / (counts[node] + 1)
        token_ids.append(tokens[child])
        score += probability
        node, depth = child, depth + 1
    return Draft(token_ids, score, length, probability, smoothed) if token_ids else None


def _reanchor(trie: SuffixTrie, tail: Sequence[int], drafted: list[int]) -> tuple[int, int]:
    """(node, depth) of the longest suffix of `tail + drafted`, at most 2/3 of the depth (room
    to draft a third of it before the next re-anchoring), that has a continuation; (-1, 0) if
    none. Walks from the root: O(depth) lookups, once every ~depth/3 drafted tokens."""
    edges = trie.edges
    window = [*tail, *drafted][-(2 * trie.max_depth // 3):]
    for start in range(len(window)):
        node = ROOT
        for token_id in window[start:]:
            node = edges.get(node * EDGE_STRIDE + token_id, NO_CHILD)
            if node < 0:
                break
        if node > ROOT and trie.best[node] >= 0:
            return node, len(window) - start
    return NO_CHILD, 0
