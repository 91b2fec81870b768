"""`auto`: per request and per step, the source whose draft promises the most tokens per second:
the suffix tries (the request's own context and its tenant's finished requests), n-gram lookup
over the request's own context, or the EAGLE draft head where one is loaded.

Each source has its own acceptance tracker on the request. The lookups' drafts are computed
first (they cost microseconds); a draft of L tokens from a source whose acceptance is a gains
sum(a^i, i = 1..L) tokens for L more verified rows, and the head's K drafts the same for K rows
plus its sequential draft steps, all priced by the controller's fitted step cost. The best ratio
of expected tokens to expected seconds wins; the controller then sizes K by the chosen source's
tracker (`request.acceptance`), as for any other method. Sources not chosen drift back towards
their prior, so they are tried again later. Lookup drafts are one-hot, the head's carry their
distribution: verification keeps the target's law whichever source drafted.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import Request
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE, AcceptanceTracker
from engine.spec_decode.step_cost import LinearCostModel, ModelDraftCost
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.head_retirement import HEAD_TRACKER
from engine.spec_decode.ngram import NgramLookup, ValidPrefix
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.suffix import SuffixProposer, chain_prior

HEAD = HEAD_TRACKER  # the head's source name, and its tracker's key


def expected_gain(acceptance: float, num_drafts: int) -> float:
    """Expected accepted tokens of a chain of `num_drafts` drafts, each accepted with
    probability `acceptance` once the ones before it were."""
    if acceptance >= 1.0:
        return float(num_drafts)
    return acceptance * (1 - acceptance ** num_drafts) / (1 - acceptance)


class AutoProposer(Proposer):
    name = "auto"
    continues_drafts = True

    def __init__(self, suffix: SuffixProposer, ngram: NgramLookup, step_cost: LinearCostModel,
                 head: EagleProposer | None = None, head_cost: ModelDraftCost | None = None):
        self.suffix, self.ngram, self.head = suffix, ngram, head
        self.step_cost, self.head_cost = step_cost, head_cost
        self.keeps_own_kv = head is not None  # the head's KV, at the target's positions
        self.sits_out_steps = head is None  # the head reads the target's every step
        self._chosen: dict[str, tuple[str, list[int]]] = {}  # request id -> (source, lookup draft)

    @property
    def num_sequential_steps(self) -> int:
        return self.head.num_sequential_steps if self.head is not None else 0

    def prepare(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> None:
        self._chosen = {}
        if self.head is not None:
            self.head.convert_long_waits(requests)
        for request, k in zip(requests, max_tokens):
            if k <= 0 or request.grammar is not None:  # grammar requests draft in between
                continue
            trackers = _trackers(request, self.head.head_prior if self.head else None)
            options = self._options(request, k, trackers)
            source, draft = max(options, key=lambda option: self._rate(request, *option,
                                                                        trackers, k))
            for other, tracker in trackers.items():
                if other != source:
                    tracker.decay()
            request.acceptance = trackers[source]
            self._chosen[request.request_id] = (source, draft)

    def _options(self, request: Request, k: int,
                 trackers: dict[str, AcceptanceTracker]) -> list[tuple[str, list[int]]]:
        chain = self.suffix.best_draft(request, k)
        # The chain's confidence is the suffix tracker's prior, as with `suffix` alone.
        trackers["suffix"].prior = chain_prior(request, chain)
        options = [("suffix", chain.token_ids if chain else []),
                   ("ngram", self.ngram.continuation(request, k))]
        if self.head is not None and request.pending_features:
            options.append((HEAD, []))
        return options

    def _rate(self, request: Request, source: str, draft: list[int],
              trackers: dict[str, AcceptanceTracker], k: int) -> float:
        """Expected tokens per second of this request's step with the source's draft."""
        acceptance = trackers[source].estimate()
        num_drafts = k if source == HEAD else len(draft)
        seconds = self.step_cost(self.step_cost.request_units(request.num_computed_tokens,
                                                              1 + num_drafts))
        if source == HEAD:
            seconds += self.head_cost(num_drafts, num_drafts)
        return (1 + expected_gain(acceptance, num_drafts)) / seconds

    def _source(self, request: Request) -> str | None:
        """This step's source for the request; None for one `prepare` chose nothing for (a
        grammar request: it drafts in between forced tokens, from the lookups)."""
        chosen = self._chosen.get(request.request_id)
        return chosen[0] if chosen else None

    def drafts_are_free(self, request: Request) -> bool:
        return self._source(request) != HEAD

    def method_of(self, request: Request) -> str:
        return self._source(request) or "suffix"

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        head_ks = [k if self._source(r) == HEAD else 0 for r, k in zip(requests, num_tokens)]
        if self.head is not None and any(head_ks):
            proposal = self.head.propose(requests, head_ks)
        else:
            proposal = Proposal([[] for _ in requests])
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            source, draft = self._chosen.get(request.request_id, (None, []))
            if source != HEAD:
                proposal.draft_token_ids[i] = draft[:max(k, 0)]
        return proposal

    def continue_drafts(self, request: Request, drafts: Sequence[int], num_tokens: int,
                        valid_prefix: ValidPrefix) -> list[int]:
        return (self.suffix.continue_drafts(request, drafts, num_tokens, valid_prefix)
                or self.ngram.continuation(request, num_tokens, drafts, valid_prefix))

    def wants_features(self, requests: Sequence[Request]) -> bool:
        return self.head is not None and self.head.wants_features(requests)

    def observe_target_step(self, scheduled, row_starts, hidden, emitted) -> None:
        if self.head is not None:
            self.head.observe_target_step(scheduled, row_starts, hidden, emitted)

    def request_finished(self, request: Request) -> None:
        self.suffix.request_finished(request)

    def cache_stats(self):
        return self.suffix.cache_stats()


def _trackers(request: Request, head_prior: float | None) -> dict[str, AcceptanceTracker]:
    trackers = request.acceptance_by_source
    if not trackers:
        trackers.update(suffix=AcceptanceTracker(), ngram=AcceptanceTracker(prior=PRIOR_ACCEPTANCE))
        if head_prior is not None:
            trackers[HEAD] = AcceptanceTracker(prior=head_prior)
    return trackers
