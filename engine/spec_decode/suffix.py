"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975): drafts from a suffix trie
over the request's own prompt and output, and from a global one over the outputs of finished
requests of the same tenant, so a request can copy what earlier requests generated (agent
loops, templated pipelines, repeated prompts), not only what its own context holds.

Each step, the longest suffix of the context found in either trie (up to `max_depth - 1` tokens)
is followed along its likeliest continuations (by counts); the draft with the higher expected
number of accepted tokens wins. Drafts are chains and one-hot, so the verifier keeps the target's
law exactly. Both tries are kept up to date incrementally: a step costs O(max_depth) dict lookups
per appended token, whatever the context's length.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.request import Request
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.suffix_cache import GlobalSuffixCache, SuffixCacheStats
from engine.spec_decode.suffix_native import new_trie
from engine.spec_decode.suffix_tree import Draft

ValidPrefix = Callable[[list[int]], int]  # how many leading tokens a grammar allows
# Prompt tokens put in the global trie before a finished request's output: the end of a prompt
# (the task's last words, the chat template's assistant header) is what the first output tokens
# of a later request can match on, before it has any output of its own.
PROMPT_TAIL_TOKENS = 8
# Prompt tokens a request's own trie indexes, the last ones: its nodes grow with up to
# max_depth per token (~140 bytes each) and indexing costs ~7 us a token on the first step, so
# a 32k-token prompt would take ~100 MB and ~0.2 s; 4,096 bound that at ~14 MB and ~30 ms.
LOCAL_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class SuffixSettings:
    max_depth: int = 24  # longest substring the tries hold (vLLM's default)
    max_spec_factor: float = 1.0  # a match of m tokens drafts at most this * m
    min_token_prob: float = 0.1  # a draft stops where its path probability falls below this
    cache_prompts: bool = False  # the global trie holds whole prompts, not only their tails


class _RequestSuffixes:
    """One live request's own trie and where its context stands in its tenant's global trie."""

    def __init__(self, max_depth: int, version: int):
        self.local = new_trie(max_depth)
        self.active: list[int] = []  # local nodes of the context's suffixes, shortest first
        self.num_indexed = 0  # leading context tokens inserted into `local`
        self.version = version  # the request's num_truncations when `local` was built
        self.global_trie = None  # the tenant's trie in the global cache, when it has one
        self.global_version = -1
        self.global_matched: list[int] = []
        self.num_global_matched = 0  # leading context tokens `global_matched` has read


def build_suffix_proposer(spec) -> "SuffixProposer":
    """From a SpeculativeConfig (engine/config.py), which has checked the values."""
    settings = SuffixSettings(spec.suffix_max_depth, spec.suffix_max_spec_factor,
                              spec.suffix_min_token_prob, spec.suffix_cache_prompts)
    cache = GlobalSuffixCache(spec.suffix_max_depth, spec.suffix_cache_max_requests,
                              spec.suffix_cache_max_bytes, spec.suffix_cache_scope)
    return SuffixProposer(settings, cache)


def chain_prior(request: Request, chain: Draft | None) -> float | None:
    """The prior of the request's acceptance of this chain: 0 without one; its confidence
    (`Draft.prior_acceptance`) when the request decodes greedily; else the controller's default.
    Counts say how often a continuation followed, not how likely the target is to sample it: at
    T = 0.7, 16 concurrent rollouts of a prompt cached at T = 0 drafted long chains that were
    accepted half the time, and ran at 0.6x `none`."""
    if chain is None:
        return 0.0
    return chain.prior_acceptance if request.sampling_params.greedy else None


class SuffixProposer(Proposer):
    name = "suffix"
    continues_drafts = True
    sits_out_steps = True
    drafts_at_prefill = True

    def __init__(self, settings: SuffixSettings, cache: GlobalSuffixCache):
        self.settings = settings
        self.cache = cache
        self._states: weakref.WeakKeyDictionary[Request, _RequestSuffixes] = \
            weakref.WeakKeyDictionary()
        self._prepared: dict[str, list[int]] = {}  # this step's chains, by request id

    def prepare(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> None:
        """Drafts each request's longest chain before the controller plans, and sets its
        tracker's prior to the chain's own confidence (`Draft.prior_acceptance`): a request
        that repeats an output cached several times drafts long from its first step, where the
        default prior would have it start short, while a chain from a split continuation, or
        none at all, starts low."""
        self._prepared = {}
        for request, k in zip(requests, max_tokens):
            if k <= 0 or request.grammar is not None:  # grammar requests draft in between
                continue
            draft = self.best_draft(request, k)
            self._prepared[request.request_id] = draft.token_ids if draft else []
            request.acceptance.prior = chain_prior(request, draft)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        prepared, self._prepared = self._prepared, {}
        drafts = []
        for request, k in zip(requests, num_tokens):
            chain = prepared.get(request.request_id)
            if chain is None:
                draft = self.best_draft(request, k)
                chain = draft.token_ids if draft else []
            drafts.append(chain[:max(k, 0)])  # the controller sized k by this chain
        return Proposal(drafts)

    def continue_drafts(self, request: Request, drafts: Sequence[int], num_tokens: int,
                        valid_prefix: ValidPrefix) -> list[int]:
        for draft in self._drafts(request, num_tokens, drafts):
            token_ids = draft.token_ids[:valid_prefix(draft.token_ids)]
            if token_ids:
                return token_ids
        return []

    def request_finished(self, request: Request) -> None:
        """Puts what the request generated into its tenant's global trie."""
        self._states.pop(request, None)
        # Tokens still in flight on the device were never shown, so they are not kept either;
        # an aborted request keeps what it did generate.
        output = request.output_token_ids[:request.num_output_tokens
                                          - request.num_placeholder_tokens]
        if output:
            prompt = request.prompt_token_ids
            head = prompt if self.settings.cache_prompts else prompt[-PROMPT_TAIL_TOKENS:]
            self.cache.add(request.cache_salt, [*head, *output])

    def cache_stats(self) -> SuffixCacheStats:
        return self.cache.stats()

    # ------------------------------------------------------------------ lookups
    def best_draft(self, request: Request, num_tokens: int) -> Draft | None:
        return next(iter(self._drafts(request, num_tokens)), None)

    def _drafts(self, request: Request, num_tokens: int,
                appended: Sequence[int] = ()) -> list[Draft]:
        """The local and the global trie's chains, the higher expected gain first."""
        if num_tokens <= 0:
            return []
        state = self._up_to_date(request)
        local, matched = state.local, state.active
        global_trie, global_matched = state.global_trie, state.global_matched
        if appended:  # read across the drafts so far without indexing them
            matched = local.advance_all(matched, appended)
            if global_trie is not None:
                global_matched = global_trie.advance_all(global_matched, appended)
        settings = self.settings
        context = request.all_token_ids
        tail = [*context[max(len(context) - settings.max_depth, 0):], *appended]
        candidates = [local.draft(matched, tail, num_tokens, settings.max_spec_factor,
                                  settings.min_token_prob)]
        if global_trie is not None:
            candidates.append(global_trie.draft(global_matched, tail, num_tokens,
                                                settings.max_spec_factor,
                                                settings.min_token_prob))
        return sorted((c for c in candidates if c is not None), key=lambda d: d.score,
                      reverse=True)

    def _up_to_date(self, request: Request) -> _RequestSuffixes:
        """The request's state with every context token read: appended tokens extend the local
        trie and advance the global match; a changed global trie is matched afresh."""
        state = self._states.get(request)
        context = request.all_token_ids
        if state is None or state.version != request.num_truncations \
                or len(context) < state.num_indexed:
            # Tokens taken back (a stop string inside accepted drafts): start again.
            state = self._states[request] = _RequestSuffixes(self.settings.max_depth,
                                                             request.num_truncations)
            state.num_indexed = max(len(context) - LOCAL_PROMPT_TOKENS, 0)
        state.active = state.local.extend_all(state.active, context[state.num_indexed:])
        state.num_indexed = len(context)
        trie = self.cache.trie(request.cache_salt)
        if trie is None:
            state.global_trie = None
        elif trie is not state.global_trie or trie.version != state.global_version \
                or len(context) < state.num_global_matched:
            state.global_trie, state.global_version = trie, trie.version
            state.global_matched = trie.match(context[-(trie.max_depth - 1):])
        else:
            state.global_matched = trie.advance_all(state.global_matched,
                                                    context[state.num_global_matched:])
        state.num_global_matched = len(context)
        return state
