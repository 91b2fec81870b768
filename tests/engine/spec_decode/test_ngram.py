"""Tests of engine.spec_decode.ngram (prompt lookup): which earlier occurrence is copied, how much
of it, and the proposer's configuration checks."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import NgramIndex, NgramProposer, find_continuation


def make_request(prompt_token_ids, output_token_ids=(), request_id="r"):
    request = Request(request_id, list(prompt_token_ids), SamplingParams())
    for token_id in output_token_ids:
        request.append_output_token(token_id)
    return request


def test_longest_ngram_is_preferred_over_a_more_recent_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurs at 0 (followed by 10, 11); the 2-gram [2, 3] and the
    # 1-gram [3] also occur later, at 5 (followed by 20, 21).
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    assert find_continuation(tokens, 2, ngram_max=3, ngram_min=1) == [10, 11]
    assert find_continuation(tokens, 2, ngram_max=2, ngram_min=1) == [20, 21]


def test_most_recent_occurrence_is_used():
    tokens = [5, 6, 1, 5, 7, 2, 5, 8, 3, 5]
    assert find_continuation(tokens, 1, ngram_max=1, ngram_min=1) == [8]
    tokens = [0, 4, 5, 6, 0, 4, 5, 7, 0, 4, 5]  # [0, 4, 5] occurs at 0 and at 4
    assert find_continuation(tokens, 3, ngram_max=3, ngram_min=1) == [7, 0, 4]


def test_continuation_is_truncated_to_num_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert find_continuation(tokens, 3, ngram_max=2, ngram_min=1) == [3, 4, 5]
    assert find_continuation(tokens, 1, ngram_max=2, ngram_min=1) == [3]


def test_continuation_is_truncated_at_the_end_of_the_sequence():
    tokens = [7, 8, 9, 7, 8]  # the match at 0 is followed by 9, 7, 8 and then nothing
    assert find_continuation(tokens, 10, ngram_max=2, ngram_min=1) == [9, 7, 8]
    # In a run of one token the latest occurrence overlaps the suffix: one token is left after it.
    assert find_continuation([3, 3, 3, 3], 5, ngram_max=2, ngram_min=1) == [3]
    assert find_continuation([3, 3], 5, ngram_max=4, ngram_min=1) == [3]


def test_no_match_gives_nothing():
    assert find_continuation([1, 2, 3, 4, 5], 3, ngram_max=3, ngram_min=1) == []
    assert find_continuation([], 3, ngram_max=3, ngram_min=1) == []
    assert find_continuation([1], 3, ngram_max=3, ngram_min=1) == []


def test_ngram_min_excludes_shorter_matches():
    tokens = [9, 4, 6, 1, 2, 5, 4]  # only the 1-gram [4] occurs earlier
    assert find_continuation(tokens, 2, ngram_max=3, ngram_min=1) == [6, 1]
    assert find_continuation(tokens, 2, ngram_max=3, ngram_min=2) == []
    tokens = [9, 4, 6, 1, 9, 4]  # the 2-gram [9, 4] does
    assert find_continuation(tokens, 2, ngram_max=3, ngram_min=2) == [6, 1]


def test_ngram_max_excludes_longer_matches():
    # With ngram_max 1 only the last token is looked up, and its latest earlier occurrence is at 5.
    tokens = [1, 2, 3, 10, 2, 3, 20, 1, 2, 3]
    assert find_continuation(tokens, 1, ngram_max=3, ngram_min=1) == [10]
    assert find_continuation(tokens, 1, ngram_max=1, ngram_min=1) == [20]


def test_zero_or_negative_num_tokens_gives_nothing():
    tokens = [1, 2, 1]
    assert find_continuation(tokens, 0, ngram_max=2, ngram_min=1) == []
    assert find_continuation(tokens, -1, ngram_max=2, ngram_min=1) == []


@pytest.mark.parametrize("ngram_max, ngram_min", [(3, 0), (2, 3), (0, 0), (-1, 1)])
def test_invalid_config_raises(ngram_max, ngram_min):
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer(ngram_max=ngram_max, ngram_min=ngram_min)


def test_proposer_looks_up_prompt_and_output_per_request():
    proposer = NgramProposer(ngram_max=3, ngram_min=2)
    copying = make_request([10, 11, 12, 13, 14, 15], [10, 11], request_id="copy")
    novel = make_request([1, 2, 3], [4], request_id="novel")
    short_match = make_request([7, 8, 9, 7, 8], request_id="short")
    proposal = proposer.propose([copying, novel, short_match], [3, 3, 0])
    assert proposal.draft_token_ids == [[12, 13, 14], [], []]
    assert proposal.draft_probs is None  # deterministic drafts: one-hot distributions


def test_proposer_sees_tokens_appended_after_a_truncation():
    proposer = NgramProposer(ngram_max=2, ngram_min=1)
    request = make_request([5, 6, 7, 8], [5, 6])
    assert proposer.propose([request], [2]).draft_token_ids == [[7, 8]]
    request.truncate_output(1)
    request.append_output_token(8)
    # Now the context is [5, 6, 7, 8, 5, 8]: [5, 8] never occurred, the latest [8] is at 3.
    assert proposer.propose([request], [2]).draft_token_ids == [[5, 8]]


def _index_like_scan(index_class, seed: int) -> bool:
    """Whether `index_class` answers as the scan does on a random context over a small vocabulary
    (many repeats), grown a few tokens at a time, with a truncation in the middle."""
    import random

    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
    index = index_class(ngram_max=4, ngram_min=1)
    version = 0
    for step in range(60):
        k = rng.randrange(0, 5)
        if index.continuation(tokens, k, version) != find_continuation(tokens, k, 4, 1):
            return False
        if step == 30:
            del tokens[len(tokens) // 2:]
            tokens.append(rng.randrange(6))  # taken back, then another token at the same place
            version += 1
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
    return True


def test_the_index_answers_as_the_scan_as_the_context_grows_and_is_taken_back():
    assert all(_index_like_scan(NgramIndex, seed) for seed in range(200))


def test_an_index_that_keeps_first_occurrences_or_ignores_truncation_is_caught():
    """Negative controls: the comparison above fails an index keeping each n-gram's first
    occurrence rather than its most recent, and one that does not notice taken-back tokens."""

    class FirstOccurrence(NgramIndex):
        def _extend(self, token_ids, version):
            known = self._num_indexed
            for n in range(self.ngram_min, self.ngram_max + 1):
                starts = self._starts.setdefault(n, {})
                for start in range(max(known - n, 0), len(token_ids) - n):
                    starts.setdefault(tuple(token_ids[start:start + n]), start)
            self._num_indexed = len(token_ids)

    class BlindToTruncation(NgramIndex):
        def _extend(self, token_ids, version):
            # Trusts that what it indexed is unchanged: ignores the version and reads a shorter
            # context as one it has indexed up to its length.
            self._num_indexed = min(self._num_indexed, len(token_ids))
            super()._extend(token_ids, self._version)

    assert not all(_index_like_scan(FirstOccurrence, seed) for seed in range(200))
    assert not all(_index_like_scan(BlindToTruncation, seed) for seed in range(200))


def _refusing(token_id: int):
    """A grammar's valid_prefix that refuses one token wherever it comes."""
    return lambda tokens: next((i for i, t in enumerate(tokens) if t == token_id), len(tokens))


def _lookahead_like_scan(index_class, seed: int) -> bool:
    """Whether lookups across drafts appended for the lookup only (and cut by a grammar) answer
    as the scan over the context and the drafts, searching the context's n-grams."""
    import random

    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
    index = index_class(ngram_max=4, ngram_min=1)
    for _ in range(40):
        k, appended = rng.randrange(0, 5), [rng.randrange(6) for _ in range(rng.randrange(4))]
        valid_prefix = rng.choice([None, _refusing(rng.randrange(6))])
        expected = find_continuation(tokens + appended, k, 4, 1, num_searched=len(tokens),
                                     valid_prefix=valid_prefix)
        if index.continuation(tokens, k, 0, appended, valid_prefix) != expected:
            return False
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
    return True


def test_lookups_across_appended_drafts_answer_as_the_scan():
    assert all(_lookahead_like_scan(NgramIndex, seed) for seed in range(200))
    # The scan itself: the suffix runs across the drafts, and a continuation the grammar
    # refuses at once gives way to a shorter n-gram's.
    tokens = [7, 1, 2, 9, 2, 5, 7]
    assert find_continuation(tokens + [1], 2, 3, 1, num_searched=len(tokens)) == [2, 9]
    assert find_continuation(tokens + [1, 2], 2, 3, 1, num_searched=len(tokens),
                             valid_prefix=_refusing(9)) == [5, 7]


def test_an_index_that_ignores_appended_drafts_or_indexes_them_is_caught():
    """Negative controls for the comparison above."""

    class IgnoresAppended(NgramIndex):
        def continuation(self, token_ids, num_tokens, version=0, appended=(), valid_prefix=None):
            return super().continuation(token_ids, num_tokens, version, (), valid_prefix)

    class IndexesAppended(NgramIndex):
        def continuation(self, token_ids, num_tokens, version=0, appended=(), valid_prefix=None):
            return super().continuation([*token_ids, *appended], num_tokens, version + 1,
                                        (), valid_prefix)

    assert not all(_lookahead_like_scan(IgnoresAppended, seed) for seed in range(200))
    assert not all(_lookahead_like_scan(IndexesAppended, seed) for seed in range(200))


def test_the_proposer_keeps_no_index_for_finished_requests():
    import gc

    proposer = NgramProposer(ngram_max=2, ngram_min=1)
    request = make_request([5, 6, 7, 5], request_id="gone")
    assert proposer.propose([request], [2]).draft_token_ids == [[6, 7]]
    assert len(proposer.lookup._indexes) == 1
    del request
    gc.collect()
    assert len(proposer.lookup._indexes) == 0
