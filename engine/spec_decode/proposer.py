"""The interface every proposer implements: given requests and a draft length each, guess tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.core.request import Request


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]  # per request, at most the asked number of tokens
    # Per request [num_drafts, vocab] distributions the drafts were drawn from, or None for a
    # proposer that picks tokens deterministically (its distribution is one-hot on its pick).
    draft_probs: list[torch.Tensor | None] | None = None


class Proposer(ABC):
    name: str = "none"
    # Whether `continue_drafts` works: guesses that are deterministic and cost no model work,
    # so a grammar request's forced tokens can be followed by guesses in the same step.
    continues_drafts: bool = False
    # Whether it keeps KV of its own at the requests' block tables (a draft model, a draft
    # head): then no block is released behind a sliding window, since its KV may lag.
    keeps_own_kv: bool = False
    # Whether its drafts follow from the request's tokens alone, with nothing of its own (KV,
    # the target's features) that must see every step: then steps it drafts nothing for may
    # run quiet and overlap (quiet_steps.py). A draft model or head must see every token.
    sits_out_steps: bool = False
    # Whether it can guess the first tokens of the answer from the prompt alone, so that a
    # prompt's last chunk verifies them in the same step (prefill_drafts.py): a lookup in the
    # tokens can; a draft model or head must first see the prompt's own step.
    drafts_at_prefill: bool = False

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """Guesses up to `num_tokens[i]` tokens to follow `requests[i].all_token_ids`.

        Called after the scheduler has reserved KV slots for the drafts, so a model-based
        proposer may write its KV at the draft positions of each request's block table.
        """

    def continue_drafts(self, request: Request, drafts: Sequence[int], num_tokens: int,
                        valid_prefix: Callable[[list[int]], int]) -> list[int]:
        """Guesses up to `num_tokens` tokens to follow `request.all_token_ids + drafts`, of
        which `valid_prefix` (a grammar's, in the state after `drafts`) allows all; it may
        look for another guess where its first is refused."""
        raise NotImplementedError(f"{self.name} cannot continue drafts")

    def drafts_are_free(self, request: Request) -> bool:
        """After `prepare`: whether this request's drafts this step cost no drafting work (a
        lookup's copy where the proposer otherwise runs a model), so the controller prices
        only their verification."""
        return False

    def method_of(self, request: Request) -> str:
        """After `prepare`: the method this request's drafts this step come from, as usage and
        the metrics count them (a proposer with several sources names the one chosen)."""
        return self.name

    def prepare(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> None:
        """Before the controller plans a step: a proposer with several sources picks one per
        request and points `request.acceptance` at that source's tracker, so the controller
        sizes K by the acceptance of what will actually be proposed."""

    def request_finished(self, request: Request) -> None:
        """When a request ends (finished or aborted), before it is dropped: a proposer that
        learns across requests (suffix) keeps what it generated."""

    def wants_features(self, requests: Sequence[Request]) -> bool:
        """Whether the target's step over these requests should return the feature layers'
        rows too (`LlamaForCausalLM.feature_layers`): a draft head reads them; without them
        the step runs as `none`'s does."""
        return False

    def observe_target_step(self, scheduled, row_starts, hidden: torch.Tensor,
                            emitted: Sequence[Sequence[int]]) -> None:
        """After each target step, before the scheduler records it: the step's hidden states
        (request i's fed tokens from row `row_starts[i]`) and the tokens each request emitted.
        Proposers that read the target's features keep what they need; others ignore it."""
