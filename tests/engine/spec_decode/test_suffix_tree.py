"""The suffix trie against brute force: counts of every substring, matches, drafts, removal."""

import random
from collections import Counter

import pytest

from engine.spec_decode.suffix_tree import (
    EDGE_STRIDE,
    ROOT,
    SuffixTrie,
    advance,
    draft_from,
    match,
)


def brute_counts(sequences, max_depth):
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(trie):
    children = {}
    for key, child in trie.edges.items():
        children.setdefault(key // EDGE_STRIDE, []).append((key % EDGE_STRIDE, child))
    counts, stack = Counter(), [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in children.get(node, []):
            counts[path + (token,)] = trie.counts[child]
            stack.append((path + (token,), child))
    return counts


def test_counts_every_substring_up_to_the_depth_and_removal_takes_them_back():
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    trie = SuffixTrie(max_depth=6)
    for seq in sequences:
        trie.insert(seq)
    assert trie_counts(trie) == brute_counts(sequences, 6)
    assert trie.num_nodes == 1 + len(brute_counts(sequences, 6))
    for seq in sequences[:3]:
        trie.remove(seq)
    assert trie_counts(trie) == brute_counts(sequences[3:], 6)
    assert trie.num_nodes == 1 + len(brute_counts(sequences[3:], 6))
    # freed node ids are reused, and the counts stay exact
    trie.insert(sequences[0])
    assert trie_counts(trie) == brute_counts(sequences[3:] + sequences[:1], 6)
    assert trie.num_nodes == 1 + len(brute_counts(sequences[3:] + sequences[:1], 6))
    # negative control: a different set of sequences counts differently
    assert trie_counts(trie) != brute_counts(sequences[2:], 6)


def test_matcher_holds_the_longest_suffix_found_and_advances_incrementally():
    rng = random.Random(1)
    stored = [rng.randrange(4) for _ in range(60)]
    trie = SuffixTrie(max_depth=8)
    trie.insert(stored)
    substrings = brute_counts([stored], 8)
    context = [rng.randrange(4) for _ in range(30)]
    matched = []
    for i, token in enumerate(context):
        matched = advance(trie, matched, token)
        upto = context[:i + 1]
        longest = max((n for n in range(1, min(7, len(upto)) + 1)
                       if tuple(upto[-n:]) in substrings), default=0)
        assert len(matched) == longest
        assert [trie.counts[node] for node in matched] == \
            [substrings[tuple(upto[-n:])] for n in range(1, longest + 1)]
    assert match(trie, context) == matched


def test_draft_follows_the_likeliest_continuation_and_stops_below_min_prob():
    trie = SuffixTrie(max_depth=16)
    for _ in range(3):
        trie.insert([1, 2, 3, 4, 5, 6])
    trie.insert([1, 2, 3, 9, 9, 9])
    matched = match(trie, [7, 1, 2, 3])
    draft = draft_from(trie, matched, num_tokens=3, max_spec_factor=1.0, min_token_prob=0.1)
    assert draft.token_ids == [4, 5, 6] and draft.match_length == 3
    assert draft.score == pytest.approx(3 * 0.75)
    # the 3:1 split is below a 0.8 threshold: no draft
    assert draft_from(trie, matched, 3, 1.0, 0.8) is None
    # max_spec_factor: a one-token match drafts at most half a token, rounded up to one
    one = draft_from(trie, match(trie, [8, 4]), 3, 0.5, 0.1)
    assert one.token_ids == [5]


def test_a_draft_never_runs_past_the_trie_depth():
    trie = SuffixTrie(max_depth=4)
    trie.insert(list(range(20)))
    draft = draft_from(trie, match(trie, [0, 1, 2, 3, 4, 5]), 5, 4.0, 0.0)
    assert draft.match_length + len(draft.token_ids) <= 4
    assert draft.token_ids == list(range(6, 6 + len(draft.token_ids)))
