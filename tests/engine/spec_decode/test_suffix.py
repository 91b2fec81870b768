"""The suffix proposer: drafts from the request's own context and from finished requests of the
same tenant only; the global cache's bounds."""

import pytest

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.suffix import PROMPT_TAIL_TOKENS, build_suffix_proposer
from tests.engine.spec_decode.suffix_helpers import finished, phrase_text

ANSWER = [501, 502, 503, 504, 505, 506, 507, 508, 509, 510]
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def proposer(**options):
    return build_suffix_proposer(SpeculativeConfig(speculative_method="suffix", **options))


def live(prompt, output=(), salt=""):
    request = Request("live", list(prompt), SamplingParams(), cache_salt=salt)
    for token in output:
        request.append_output_token(token)
    return request


def test_drafts_from_the_requests_own_context():
    suffix = proposer()
    request = live([1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert suffix.propose([request], [3]).draft_token_ids == [[4, 5, 6]]
    request.append_output_token(4)  # incremental: the next step reads one more token
    assert suffix.propose([request], [2]).draft_token_ids == [[5, 6]]


def test_a_finished_requests_output_drafts_for_the_same_tenant_only():
    suffix = proposer()
    suffix.request_finished(finished(PROMPT, ANSWER, salt="alice"))
    # The same prompt again: its first tokens match the cached prompt tail, then the answer.
    same = live(PROMPT, ANSWER[:3], salt="alice")
    other = live(PROMPT, ANSWER[:3], salt="bob")
    drafts = suffix.propose([same, other], [4, 4]).draft_token_ids
    assert drafts[0] == ANSWER[3:7]  # the negative control: the same tenant does get them
    assert drafts[1] == []
    # at the very start, the cached prompt tail predicts the answer's first tokens
    assert suffix.propose([live(PROMPT, salt="alice")], [2]).draft_token_ids == [ANSWER[:2]]
    assert suffix.propose([live(PROMPT, salt="bob")], [2]).draft_token_ids == [[]]


def test_global_scope_shares_outputs_across_tenants():
    suffix = proposer(suffix_cache_scope="global")
    suffix.request_finished(finished(PROMPT, ANSWER, salt="alice"))
    assert suffix.propose([live(PROMPT, ANSWER[:3], salt="bob")], [4]).draft_token_ids == \
        [ANSWER[3:7]]


def test_the_oldest_requests_are_evicted_past_either_bound():
    suffix = proposer(suffix_cache_max_requests=2)
    outputs = [[1000 * i + t for t in range(20)] for i in range(1, 4)]
    for output in outputs:
        suffix.request_finished(finished([1, 2], output))
    stats = suffix.cache_stats()
    assert (stats.num_requests, stats.num_evictions) == (2, 1)
    assert suffix.propose([live([5], outputs[0][:4])], [3]).draft_token_ids == [[]]
    assert suffix.propose([live([5], outputs[2][:4])], [3]).draft_token_ids == \
        [outputs[2][4:7]]
    one = proposer()
    one.request_finished(finished([1, 2], outputs[2]))
    one_bytes = one.cache_stats().num_bytes
    two = proposer()
    for output in outputs[:2]:
        two.request_finished(finished([1, 2], output))
    budget = (one_bytes + two.cache_stats().num_bytes) // 2  # room for one request, not two
    small = proposer(suffix_cache_max_bytes=budget)
    for output in outputs:
        small.request_finished(finished([1, 2], output))
    assert small.cache_stats().num_bytes <= budget
    assert small.cache_stats().num_requests == 1 and small.cache_stats().num_evictions == 2


def test_evicting_everything_empties_the_cache():
    suffix = proposer(suffix_cache_max_requests=1)
    suffix.request_finished(finished([1], [2, 3, 4]))
    suffix.request_finished(finished([5], [6, 7, 8]))
    assert suffix.cache_stats().num_requests == 1
    suffix.cache.max_bytes = 1  # the next request alone is over the budget: nothing stays
    suffix.request_finished(finished([9], [10]))
    stats = suffix.cache_stats()
    assert (stats.num_requests, stats.num_nodes, stats.num_partitions) == (0, 0, 0)
    assert stats.num_evictions == 3


def test_a_live_match_follows_insertions_and_evictions():
    suffix = proposer(suffix_cache_max_requests=1)
    request = live([1, 2], [300, 301])
    assert suffix.propose([request], [2]).draft_token_ids == [[]]
    suffix.request_finished(finished([9], [300, 301, 302, 303]))
    assert suffix.propose([request], [2]).draft_token_ids == [[302, 303]]
    suffix.request_finished(finished([9], [700, 701]))  # evicts the first
    assert suffix.propose([request], [2]).draft_token_ids == [[]]


def test_continued_drafts_read_across_earlier_drafts_and_obey_the_grammar():
    suffix = proposer()
    suffix.request_finished(finished(PROMPT, ANSWER))
    request = live(PROMPT, ANSWER[:2])
    allow_two = lambda tokens: min(len(tokens), 2)  # noqa: E731
    assert suffix.continue_drafts(request, ANSWER[2:4], 4, allow_two) == ANSWER[4:6]
    assert suffix.continue_drafts(request, [], 4, lambda tokens: 0) == []


def test_taken_back_tokens_rebuild_the_requests_trie():
    suffix = proposer()
    request = live([1, 2, 3, 1, 2], [3, 9, 9])
    suffix.propose([request], [2])
    request.truncate_output(0)  # a stop string: the output is taken back
    assert suffix.propose([request], [2]).draft_token_ids == [[3, 1]]


def test_an_aborted_request_without_output_adds_nothing():
    suffix = proposer()
    request = live(PROMPT)
    request.status = RequestStatus.FINISHED_ABORTED
    suffix.request_finished(request)
    assert suffix.cache_stats().num_requests == 0
    suffix.request_finished(finished(PROMPT, ANSWER))
    assert suffix.cache_stats().num_requests == 1
    assert PROMPT_TAIL_TOKENS <= len(PROMPT)


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (mallinfo2): what the C++ trie
    allocates, which tracemalloc does not see."""
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no mallinfo2 here (glibc < 2.33)")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("trie", ["python", "native"])
def test_the_byte_budget_bounds_what_the_cache_really_holds(trie, monkeypatch):
    """The count the budget is checked against is not below the memory really allocated
    (tracemalloc for the Python trie, malloc for the C++ one), so a cache at its budget holds
    at most about that much."""
    import tracemalloc

    from engine.spec_decode import suffix_native

    if trie == "python":
        monkeypatch.setattr(suffix_native, "native_trie_class", lambda: None)
    elif suffix_native.native_trie_class() is None:
        pytest.skip("the C++ suffix trie did not build here")
    text = phrase_text(0)
    budget = 2 * 2**20
    before = malloc_in_use() if trie == "native" else 0
    tracemalloc.start()
    try:
        suffix = proposer(suffix_cache_max_bytes=budget)
        for _ in range(60 if trie == "python" else 200):
            suffix.request_finished(finished(text(8), text(120)))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if trie == "native":
        held = malloc_in_use() - before
    stats = suffix.cache_stats()
    assert stats.num_evictions > 0 and stats.num_bytes <= budget
    assert held <= 1.1 * budget
    # and the count is not far above it either: a cache at its budget does hold about that
    assert held >= 0.6 * stats.num_bytes


def test_a_cache_at_its_budget_evicts_a_little_at_a_time(monkeypatch):
    """Room is made before an insert: a full cache evicts about as much as each request adds.
    Evicting after the insert let a table double past the budget, and the cache then evicted
    until a rebuild halved it (the negative control)."""
    from engine.spec_decode import suffix_native
    from engine.spec_decode.suffix_cache import GlobalSuffixCache

    if suffix_native.native_trie_class() is None:
        pytest.skip("the C++ suffix trie did not build here")

    def held_over_time(cache):
        text, counts = phrase_text(1), []
        for _ in range(600):
            cache.add("", text(120))
            counts.append(cache.stats().num_requests)
            assert cache.num_bytes <= cache.max_bytes
        return counts[counts.index(max(counts)):]  # from the first time it was full

    budget = 2 * 2**20
    steady = held_over_time(GlobalSuffixCache(24, 10_000, budget))
    assert min(steady) > 0.8 * max(steady), (min(steady), max(steady))

    class EvictingAfter(GlobalSuffixCache):
        def _make_room(self, partition, tokens):
            pass

    halved = held_over_time(EvictingAfter(24, 10_000, budget))
    assert min(halved) < 0.6 * max(halved)


def test_a_long_prompt_is_indexed_from_its_last_tokens_only(monkeypatch):
    from engine.spec_decode import suffix as suffix_module

    monkeypatch.setattr(suffix_module, "LOCAL_PROMPT_TOKENS", 20)
    filler = list(range(100, 130))
    early = live([1, 2, 3, 4, 5, *filler, 1, 2, 3])  # the match lies before the last 20
    late = live([*filler, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])  # and here within them
    drafts = proposer().propose([early, late], [2, 2]).draft_token_ids
    assert drafts == [[], [4, 5]]


def test_the_chains_confidence_is_the_prior_of_greedy_requests_only():
    suffix = proposer()
    for _ in range(3):
        suffix.request_finished(finished(PROMPT, ANSWER))
    greedy = Request("greedy", list(PROMPT), SamplingParams(temperature=0.0))
    for token in ANSWER[:2]:
        greedy.append_output_token(token)
    sampled = Request("sampled", list(PROMPT), SamplingParams(temperature=0.7, seed=1))
    for token in ANSWER[:2]:
        sampled.append_output_token(token)
    unmatched = live([900, 901, 902])
    suffix.prepare([greedy, sampled, unmatched], [4, 4, 4])
    # seen three times: 3 of (3 + 1) at every step of the chain
    assert greedy.acceptance.prior == pytest.approx(0.75)
    assert sampled.acceptance.prior is None  # the controller's default prior
    assert unmatched.acceptance.prior == 0.0  # nothing to verify
    drafts = suffix.propose([greedy, sampled, unmatched], [4, 2, 4]).draft_token_ids
    assert drafts == [ANSWER[2:6], ANSWER[2:4], []]
