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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Estimated bytes of one node: the object with three slots (56) and, for a node with children, a
# small dict (224 on CPython 3.11). Most nodes of a deep trie are in chains of one child each.
NODE_BYTES = 280


class Node:
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] | None = None
        # The token of the child with the highest count, or None when not known (recomputed on
        # read): kept up on increments, so a draft step is O(1), not O(children).
        self.best: int | None = None

    def best_child(self) -> tuple[int, Node] | None:
        children = self.children
        if not children:
            return None
        best = self.best
        if best is None:
            best = self.best = max(children, key=lambda token: children[token].count)
        return best, children[best]


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    score: float  # expected accepted tokens: the sum of the drafts' path probabilities
    match_length: int


class SuffixTrie:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"--suffix-max-depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 1
        # Bumped by every insertion and removal: a Matcher built on an older version may miss a
        # longer match, or hold nodes a removal dropped, and starts again.
        self.version = 0

    def extend(self, active: list[Node], token_id: int) -> list[Node]:
        """Inserts one token after the suffixes `active` (the nodes of the current substrings,
        shortest first, up to max_depth - 1 long); returns the nodes that end at it."""
        extended = []
        for node in (self.root, *active[:self.max_depth - 1]):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(token_id)
            if child is None:
                child = children[token_id] = Node()
                self.num_nodes += 1
            child.count += 1
            best = node.best
            if best is not None and best != token_id and child.count > children[best].count:
                node.best = token_id
            extended.append(child)
        return extended

    def insert(self, token_ids: Iterable[int]) -> None:
        self.version += 1
        active: list[Node] = []
        for token_id in token_ids:
            active = self.extend(active, token_id)

    def remove(self, token_ids: Sequence[int]) -> None:
        """Takes back one earlier `insert(token_ids)`. A child whose count falls to 0 goes with
        its subtree: counts never grow with depth, so all of that subtree counted only the
        occurrence removed, a chain of its remaining tokens."""
        self.version += 1
        length = len(token_ids)
        for start in range(length):
            node = self.root
            end = min(start + self.max_depth, length)
            for position in range(start, end):
                token_id = token_ids[position]
                child = node.children[token_id]
                child.count -= 1
                if node.best == token_id:
                    node.best = None
                if child.count == 0:
                    del node.children[token_id]
                    self.num_nodes -= end - position
                    break
                node = child

    @property
    def num_bytes(self) -> int:
        return self.num_nodes * NODE_BYTES


def advance(trie: SuffixTrie, matched: list[Node], token_id: int) -> list[Node]:
    """The nodes of the suffixes that end at `token_id` after those of `matched` (shortest
    first), without inserting anything. Stops at the first suffix the trie lacks: no longer
    one can be there."""
    advanced = []
    for node in (trie.root, *matched[:trie.max_depth - 1]):
        children = node.children
        child = children.get(token_id) if children else None
        if child is None:
            break
        advanced.append(child)
    return advanced


def match(trie: SuffixTrie, token_ids: Sequence[int]) -> list[Node]:
    """`advance` over the last max_depth - 1 tokens: O(max_depth^2) lookups, for a fresh start."""
    matched: list[Node] = []
    for token_id in token_ids[len(token_ids) - (trie.max_depth - 1):]:
        matched = advance(trie, matched, token_id)
    return matched


def draft_from(matched: Sequence[Node], num_tokens: int, max_depth: int,
               max_spec_factor: float, min_token_prob: float) -> Draft | None:
    """The chain of likeliest continuations of the longest matched suffix that has any. A
    match of length m drafts at most max_spec_factor * m tokens (short matches guess badly),
    and a draft stops where its path probability (the product of count ratios) falls below
    min_token_prob. Matches longer than max_depth - num_tokens are cut to leave the trie room to
    continue."""
    longest = min(len(matched), max(max_depth - num_tokens, 1))
    for length in range(longest, 0, -1):
        node = matched[length - 1]
        if node.children:
            break
    else:
        return None
    limit = min(num_tokens, max(1, int(max_spec_factor * length)), max_depth - length)
    token_ids: list[int] = []
    probability, score = 1.0, 0.0
    while len(token_ids) < limit:
        found = node.best_child()
        if found is None:
            break
        token_id, child = found
        probability *= child.count / node.count
        if probability < min_token_prob:
            break
        token_ids.append(token_id)
        score += probability
        node = child
    return Draft(token_ids, score, length) if token_ids else None
