"""The suffix trie against brute force: counts of every substring, matches, drafts, removal.
Every test runs on both tries, the pure-Python one and the C++ one (suffix_native.py)."""

import random
from collections import Counter

import pytest

from engine.spec_decode.suffix_native import native_trie_class
from engine.spec_decode.suffix_tree import ROOT, SuffixTrie


@pytest.fixture(params=["python", "native"])
def make_trie(request):
    if request.param == "python":
        return SuffixTrie
    native = native_trie_class()
    if native is None:
        pytest.skip("the C++ suffix trie did not build here (no compiler)")
    return native


def brute_counts(sequences, max_depth):
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(trie):
    children = {}
    for parent, token, child in trie.edge_list():
        children.setdefault(parent, []).append((token, child))
    counts, stack = Counter(), [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in children.get(node, []):
            counts[path + (token,)] = trie.count(child)
            stack.append((path + (token,), child))
    return counts


def test_counts_every_substring_up_to_the_depth_and_removal_takes_them_back(make_trie):
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    trie = make_trie(6)
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


def test_matcher_holds_the_longest_suffix_found_and_advances_incrementally(make_trie):
    rng = random.Random(1)
    stored = [rng.randrange(4) for _ in range(60)]
    trie = make_trie(8)
    trie.insert(stored)
    substrings = brute_counts([stored], 8)
    context = [rng.randrange(4) for _ in range(30)]
    matched = []
    for i, token in enumerate(context):
        matched = trie.advance_all(matched, [token])
        upto = context[:i + 1]
        longest = max((n for n in range(1, min(7, len(upto)) + 1)
                       if tuple(upto[-n:]) in substrings), default=0)
        assert len(matched) == longest
        assert [trie.count(node) for node in matched] == \
            [substrings[tuple(upto[-n:])] for n in range(1, longest + 1)]
    assert trie.match(context[-7:]) == matched


def test_draft_follows_the_likeliest_continuation_and_stops_below_min_prob(make_trie):
    trie = make_trie(16)
    for _ in range(3):
        trie.insert([1, 2, 3, 4, 5, 6])
    trie.insert([1, 2, 3, 9, 9, 9])
    context = [7, 1, 2, 3]
    matched = trie.match(context)
    draft = trie.draft(matched, context, num_tokens=3, max_spec_factor=1.0,
                       min_token_prob=0.1)
    assert draft.token_ids == [4, 5, 6] and draft.match_length == 3
    assert draft.score == pytest.approx(3 * 0.75)
    assert draft.path_probability == pytest.approx(0.75)
    # smoothed: 3 of 4 (+1) at the split, then 3 of 3 (+1) twice
    assert draft.prior_acceptance == pytest.approx((3 / 5 * 3 / 4 * 3 / 4) ** (1 / 3))
    # the 3:1 split is below a 0.8 threshold: no draft
    assert trie.draft(matched, context, 3, 1.0, 0.8) is None
    # max_spec_factor: a one-token match drafts at most half a token, rounded up to one
    one = trie.draft(trie.match([8, 4]), [8, 4], 3, 0.5, 0.1)
    assert one.token_ids == [5]


def test_a_long_copy_drafts_past_the_trie_depth_from_shorter_suffixes(make_trie):
    """A trie of depth 6 holds no substring longer than 6 tokens, yet a chain re-anchors on the
    last tokens of context and draft and follows the whole inserted sequence."""
    trie = make_trie(6)
    sequence = list(range(100, 140))
    trie.insert(sequence)
    context = sequence[:5]
    draft = trie.draft(trie.match(context), context, 30, 10.0, 0.0)
    assert draft.token_ids == sequence[5:35]
    assert draft.match_length == 5 and draft.path_probability == 1.0
    # the chain ends where the sequence does, past any re-anchoring
    near_end = sequence[:-3]
    assert trie.draft(trie.match(near_end), near_end, 30, 10.0, 0.0).token_ids == \
        sequence[-3:]
    # A second sequence shares a 3-token stretch and goes on differently: re-anchoring on the
    # longest suffix (4 tokens here) still tells the two apart, and the chain stays certain...
    trie.insert([1, 2, *sequence[10:13], 7, 7, 7])
    draft = trie.draft(trie.match(context), context, 30, 10.0, 0.0)
    assert draft.token_ids == sequence[5:35] and draft.path_probability == 1.0
    # ...where a context of only the shared stretch sees both continuations, half each
    shared = sequence[10:13]
    split = trie.draft(trie.match(shared), shared, 30, 10.0, 0.0)
    assert split.path_probability == 0.5
