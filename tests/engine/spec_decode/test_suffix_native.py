"""The C++ suffix trie against the Python one: the same node ids, counts, matches and drafts on
random traffic (inserts, removals, incremental extension), and the proposer drafting the same
tokens on either; what it holds in memory; node ids it never gave out are refused."""

import random

import pytest

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode import suffix_native
from engine.spec_decode.suffix import build_suffix_proposer
from engine.spec_decode.suffix_tree import SuffixTrie
from tests.engine.spec_decode.suffix_helpers import finished, phrase_text


@pytest.fixture(scope="module")
def native():
    cls = suffix_native.native_trie_class()
    if cls is None:
        pytest.skip("the C++ suffix trie did not build here (no compiler)")
    return cls


def state(trie):
    return (sorted(trie.edge_list()), trie.num_nodes, trie.num_free_slots, trie.version)


def drafts(trie, contexts):
    """Each context's match and its drafts under a few settings."""
    found = []
    for context in contexts:
        matched = trie.match(context)
        # 1e300: a factor whose product with the match length overflows an int
        for num_tokens, factor, min_prob in ((3, 1.0, 0.1), (30, 10.0, 0.0), (8, 0.5, 0.3),
                                             (20, 1e300, 0.0)):
            draft = trie.draft(matched, context[-trie.max_depth:], num_tokens, factor, min_prob)
            found.append((matched, None if draft is None else (
                draft.token_ids, draft.score, draft.match_length, draft.path_probability,
                draft.smoothed_probability)))
    return found


def test_random_traffic_gives_the_same_trie_matches_and_drafts(native):
    rng = random.Random(0)
    python, cpp = SuffixTrie(6), native(6)
    held, most_freed = [], 0
    for step in range(120):
        if held and rng.random() < 0.4:
            sequence = held.pop(rng.randrange(len(held)))
            python.remove(sequence)
            cpp.remove(sequence)
        else:
            # a small vocabulary, so substrings are shared, split and freed
            sequence = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
            held.append(sequence)
            python.insert(sequence)
            cpp.insert(sequence)
        assert state(cpp) == state(python), step
        contexts = [[rng.randrange(6) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
        assert drafts(cpp, contexts) == drafts(python, contexts), step
        most_freed = max(most_freed, python.num_free_slots)
    assert most_freed > 0  # removals freed ids, which later inserts reused
    # Negative control: one more sequence in one trie shows in the comparison.
    cpp.insert([0, 1, 2, 3, 4, 5])
    assert state(cpp) != state(python)


def test_incremental_extension_and_advance_match_the_python_trie(native):
    rng = random.Random(1)
    stream = [rng.randrange(5) for _ in range(300)]
    python, cpp = SuffixTrie(8), native(8)
    active_py, active_cpp, position = [], [], 0
    while position < len(stream):
        chunk = stream[position:position + rng.randrange(1, 6)]
        position += len(chunk)
        active_py = python.extend_all(active_py, chunk)
        active_cpp = cpp.extend_all(active_cpp, chunk)
        assert active_cpp == active_py
        probe = [rng.randrange(5) for _ in range(3)]
        assert cpp.advance_all(active_cpp, probe) == python.advance_all(active_py, probe)
    assert state(cpp)[:3] == state(python)[:3]


def test_node_ids_the_trie_never_gave_out_are_refused(native):
    trie = native(4)
    trie.insert([1, 2, 3])
    for bad in ([-1], [trie.num_nodes + 5]):
        with pytest.raises(ValueError, match="does not hold"):
            trie.advance_all(bad, [1])
        with pytest.raises(ValueError, match="does not hold"):
            trie.draft(bad, [1], 3, 1.0, 0.1)
    with pytest.raises(ValueError, match=">= 2"):
        native(1)
    trie.remove([9, 9, 9])  # never inserted: nothing to take back, nothing breaks
    assert trie.num_nodes == 7


def test_the_cpp_trie_holds_a_node_in_a_quarter_of_the_python_memory(native):
    rng = random.Random(2)
    python, cpp = SuffixTrie(24), native(24)
    for _ in range(40):
        sequence = [rng.randrange(49152) for _ in range(200)]
        python.insert(sequence)
        cpp.insert(sequence)
    assert cpp.num_nodes == python.num_nodes > 150_000
    assert cpp.num_bytes / cpp.num_nodes < 48  # 12 bytes of arrays + edges at 35-70% load
    assert cpp.num_bytes * 3 < python.num_bytes


def proposal_stream(monkeypatch, use_native):
    """The drafts of a suffix proposer over a templated stream, with either trie."""
    if not use_native:
        monkeypatch.setattr(suffix_native, "native_trie_class", lambda: None)
    proposer = build_suffix_proposer(SpeculativeConfig(speculative_method="suffix"))
    assert isinstance(suffix_native.new_trie(4), SuffixTrie) != use_native
    text, rng = phrase_text(3, vocab=1000, num_phrases=20, longest_phrase=6), random.Random(4)
    for _ in range(10):
        proposer.request_finished(finished(text(30), text(60)))
    stream = text(400)
    request, position, seen = Request("live", stream[:100], SamplingParams()), 100, []
    while position < len(stream):
        seen.append(proposer.propose([request], [8]).draft_token_ids[0])
        for token in stream[position:position + rng.randrange(1, 9)]:
            request.append_output_token(token)
            position += 1
    return seen, vars(proposer.cache_stats())


def test_the_proposer_drafts_the_same_tokens_on_either_trie(native, monkeypatch):
    with_cpp, cpp_stats = proposal_stream(monkeypatch, use_native=True)
    with_python, python_stats = proposal_stream(monkeypatch, use_native=False)
    assert with_cpp == with_python
    assert sum(map(len, with_cpp)) > 50  # it did draft
    assert cpp_stats["num_nodes"] == python_stats["num_nodes"]
    assert cpp_stats["num_bytes"] < python_stats["num_bytes"]
