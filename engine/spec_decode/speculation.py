"""One engine step's speculation: plan and propose drafts before the target runs, then teach the
proposer and the controller what the step showed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.grammar.drafts import constrain_drafts, interleave_drafts
from engine.spec_decode.controller import SpeculationController
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.quiet_steps import QuietSteps
from engine.spec_decode.step_cost import step_keys
from engine.spec_decode.step_periods import StepPeriods


class Speculation:
    def __init__(self, proposer: Proposer, controller: SpeculationController):
        self.proposer, self.controller = proposer, controller
        # runs of plain decode steps that overlap where drafts do not pay (quiet_steps.py)
        self.quiet = QuietSteps() if proposer.sits_out_steps else None
        # what a step of no draft costs where it runs quiet (step_periods.py)
        self.periods = StepPeriods() if self.quiet is not None else None
        self.rested = False  # every decoding request of the step being run rested

    def quiet_step_ready(self) -> bool:
        """Whether the next decode step may run as `none`'s does, overlapped."""
        return self.quiet is not None and self.quiet.ready

    def propose(self, plan: SchedulerOutput,
                padded_tokens: Callable[[int], int] | None) -> dict[str, torch.Tensor]:
        """Asks the controller how many drafts each decoding request gets and the proposer for
        them; sets `request.draft_token_ids`. `padded_tokens`: the rows the step computes for a
        draft depth, when it will run padded. Returns the draft distributions of proposers that
        sample their drafts."""
        self.rested = False
        decoding = [s for s in plan.scheduled if s.num_lookahead > 0]
        if not decoding:
            return {}
        requests = [s.request for s in decoding]
        max_ks = [s.num_lookahead for s in decoding]
        # Resting requests (controller.py) are not prepared: as when planned no draft, a
        # proposer with its own KV catches it up the next time it drafts.
        resting = self.controller.resting(requests)
        self.rested = all(resting)
        if self.rested:  # no lookup, no plan: the step runs as `none`'s does
            self.controller.rested_step()
            return {}
        max_ks = [0 if rests else k for rests, k in zip(resting, max_ks)]
        self.proposer.prepare(requests, max_ks)
        free = [self.proposer.drafts_are_free(r) for r in requests]
        # drafts not set yet: the decode rows are each request's own token
        decode_rows = [s for s in plan.scheduled if s.num_new_tokens == 1]
        # the fed token's position: a prompt's last chunk (prefill_drafts.py) feeds several
        positions = [s.request.num_computed_tokens + s.num_new_tokens - 1 for s in decoding]
        self.controller.no_draft = None if self.periods is None \
            else self.periods.no_draft_price(len(decode_rows))
        ks = self.controller.plan(requests, max_ks, self._decode_units(decode_rows),
                                  padded_tokens, free, len(decode_rows), positions)
        self.controller.after_plan(requests, max_ks, ks)
        constrained = any(r.grammar is not None for r in requests)
        if not any(ks) and not constrained:
            return {}
        # A proposer that can continue drafts guesses for grammar requests in between the
        # grammar's forced tokens (interleave_drafts) instead of up front.
        interleaved = [self.proposer.continues_drafts and r.grammar is not None
                       for r in requests]
        upfront_ks = [0 if inter else k for inter, k in zip(interleaved, ks)]
        proposal = Proposal([[] for _ in requests])
        if any(upfront_ks):
            started = time.perf_counter()
            proposal = self.proposer.propose(requests, upfront_ks)
            self.controller.observe_drafting(sum(len(d) for d, f in zip(proposal.draft_token_ids,
                                                                        free) if not f),
                                             getattr(self.proposer, "num_sequential_steps", 0),
                                             time.perf_counter() - started)
        probs = {}
        for index, (request, drafts) in enumerate(zip(requests, proposal.draft_token_ids)):
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[index]
            forced = []
            if interleaved[index]:
                # Forced drafts cost no model work, so they go even where the controller
                # planned no guesses, within the room the scheduler reserved.
                drafts, forced = interleave_drafts(
                    request.grammar, partial(self.proposer.continue_drafts, request),
                    max_ks[index], ks[index])
            elif request.grammar is not None:
                proposed = drafts
                drafts, draft_probs, num_forced = constrain_drafts(
                    request.grammar, drafts, draft_probs, max_ks[index],
                    request.sampling_params.greedy)
                forced = [True] * num_forced + [False] * (len(drafts) - num_forced)
                if num_forced:
                    # A draft model's KV holds its own drafts; past where they differ from the
                    # forced ones it must feed again.
                    same = next((j for j, (a, b) in enumerate(zip(proposed, drafts)) if a != b),
                                min(len(proposed), len(drafts)))
                    request.num_draft_computed_tokens = min(request.num_draft_computed_tokens,
                                                            request.num_tokens - 1 + same)
            request.draft_token_ids, request.forced_drafts = drafts, forced
            request.draft_method = self.proposer.method_of(request)
            if drafts and draft_probs is not None:
                probs[request.request_id] = draft_probs
        return probs

    def wants_features(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step's forward should return the draft head's feature rows."""
        return self.proposer.wants_features([s.request for s in scheduled])

    def observe(self, scheduled: Sequence[ScheduledRequest], token_row_starts: list[int],
                hidden: torch.Tensor, emitted: list[list[int]], num_rows: int,
                seconds: float) -> None:
        """After the target step: `emitted` per scheduled request (accepted drafts, then the
        next token); `num_rows`, the rows the forward computed (padding included)."""
        self.proposer.observe_target_step(scheduled, token_row_starts, hidden, emitted)
        # A rested step teaches the fit nothing the planned steps do not: it is not fitted.
        decode_only = not num_prefill_tokens(scheduled)
        if self.periods is not None and decode_only:
            self.periods.mark_sync(len(scheduled), seconds)
        if not self.rested and decode_only:
            # Only decode/verify steps teach the cost of a verified token: a prefill chunk's
            # tokens cost a fraction of that per token (one large GEMM), and fitted together
            # they made drafts look ~2x cheaper than they are in a batch.
            self.controller.observe_step(num_rows, *step_keys(
                [s.request.num_computed_tokens for s in scheduled],
                [s.num_new_tokens + len(s.request.draft_token_ids) for s in scheduled]), seconds)
        drafted_any = False
        for s, tokens in zip(scheduled, emitted):
            request: Request = s.request
            # Forced drafts say nothing of the proposer's acceptance; a rejection is always of
            # a guessed draft, as the masked target gives a forced one probability 1.
            num_guessed = len(request.draft_token_ids) - sum(request.forced_drafts)
            if num_guessed and tokens:
                num_accepted = len(tokens) - 1
                num_accepted -= sum(request.forced_drafts[:num_accepted])
                self.controller.observe_verification(request, num_guessed, num_accepted)
                drafted_any = True
        if self.quiet is not None and any(s.num_new_tokens == 1 for s in scheduled):
            self.quiet.observe(drafted_any)

    def _decode_units(self, decode_rows: Sequence[ScheduledRequest]) -> float:
        """What a step's decode rows cost in the step-cost model's row units: each request's
        fed token, its attention and its cache read. Prefill chunks are left out (see
        SpeculationController.plan)."""
        keys = step_keys([s.request.num_computed_tokens for s in decode_rows],
                         [1] * len(decode_rows))
        return self.controller.step_cost.units(len(decode_rows), *keys)


def num_prefill_tokens(scheduled: Sequence[ScheduledRequest]) -> int:
    """Tokens of the step's prefill chunks: every request feeding more than its one new token
    (drafts are not counted: they are set after planning, and verify rows are decode rows)."""
    return sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
