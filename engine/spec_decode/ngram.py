"""N-gram (prompt lookup) proposer: no model, no KV.

If the last n tokens of a request occurred earlier in its own context (prompt or output), the
tokens that followed that earlier occurrence are a good guess on copy-heavy work: editing,
summarising with quotes, code refactoring, retrieval answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.spec_decode.proposer import Proposal, Proposer


def find_continuation(token_ids: Sequence[int], num_tokens: int, ngram_max: int,
                      ngram_min: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram (ngram_max >= n >= ngram_min); [] when there is none."""
    length = len(token_ids)
    if num_tokens <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = list(token_ids[length - n:])
        first = suffix[0]
        # Most recent occurrence first: the local context is the likeliest to repeat.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == first and list(token_ids[start:start + n]) == suffix:
                return list(token_ids[start + n:start + n + num_tokens])
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {ngram_min}, {ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        return Proposal([
            find_continuation(r.all_token_ids, k, self.ngram_max, self.ngram_min)
            for r, k in zip(requests, num_tokens)
        ])
