"""Continuous batching: which requests run this step, with how many tokens each.

Every step is a flat batch of tokens under a token budget. Running requests go first, oldest first,
so decodes are never starved by a long prompt; a prompt longer than what is left of the budget is
prefilled in chunks over several steps. When KV blocks run out, the newest running request is
preempted: its blocks are freed and it is later recomputed from its tokens (prompt and output so
far), which gives the same output because sampling depends only on the request's own history.

Speculation: a request that is decoding (exactly one token, its last, not yet computed) may get
`num_lookahead` extra KV slots reserved for draft tokens. The proposer fills them after
scheduling; the verify step then feeds the last token plus the drafts, and `update_from_output`
keeps the accepted ones: rejected drafts are uncomputed again by lowering `num_computed_tokens`
and their now-empty blocks go back to the free list. Where `draft_at_prefill` is set, a chunk
that ends a prompt gets draft slots too (engine/spec_decode/prefill_drafts.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.metrics.spec_stats import SpecStats


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # of the request's own tokens, fed from request.num_computed_tokens on
    samples_token: bool  # the step reaches the request's last token, so it yields the next one
    num_lookahead: int = 0  # KV slots reserved past the last token for draft tokens

    @property
    def num_fed_tokens(self) -> int:
        """Tokens this request contributes to the batch: its own, then its draft tokens."""
        return self.num_new_tokens + len(self.request.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_fed_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec_stats = SpecStats()  # all requests, since start
        # A prompt's last chunk may carry draft slots too (engine/spec_decode/prefill_drafts.py)
        self.draft_at_prefill = False

    # ------------------------------------------------------------------ intake
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Removes the request wherever it is and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- schedule
    def schedule(self, lookahead: Callable[[Request], int] | None = None) -> SchedulerOutput:
        """Plans one step. `lookahead(request)` is how many draft slots a decoding request wants
        (the speculation controller's per-request K); None: no speculation."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_lookahead = self._draft_slots(request, num_new, budget, lookahead,
                                              num_new == 1)
            if not self._reserve_or_preempt(request, num_new + num_lookahead, out):
                break  # the request itself was the newest and got preempted
            out.scheduled.append(self._scheduled(request, num_new, num_lookahead))
            budget -= num_new + num_lookahead
            index += 1
        # New requests only when nobody had to give up blocks this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            admitted = self._admit(request, budget, lookahead)
            if admitted is None:
                break
            num_new, num_lookahead = admitted
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            out.scheduled.append(self._scheduled(request, num_new, num_lookahead))
            budget -= num_new + num_lookahead
        return out

    def _draft_slots(self, request: Request, num_new: int, budget: int,
                     lookahead: Callable[[Request], int] | None, decoding: bool) -> int:
        """Draft slots after a chunk of `num_new` tokens: the proposer's ask, within the
        step's budget and the request's room, for a decode step (`decoding`) or a chunk that
        ends the prompt (`_drafts_after`); 0 otherwise."""
        if lookahead is None or not (decoding or self._drafts_after(request, num_new)):
            return 0
        return min(lookahead(request), budget - num_new, self._room_left(request))

    def _drafts_after(self, request: Request, num_new: int) -> bool:
        """Whether a chunk of `num_new` tokens that ends the request's prompt (or its
        recomputed tokens; one token where the prefix cache held the rest) carries draft slots
        after it. A grammar request drafts from its first decode step on (its forced tokens
        follow the grammar's state after each token)."""
        return (self.draft_at_prefill and request.grammar is None
                and request.num_computed_tokens + num_new == request.num_tokens)

    def _scheduled(self, request: Request, num_new: int, num_lookahead: int = 0):
        reaches_end = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, reaches_end, num_lookahead)

    def _room_left(self, request: Request) -> int:
        """Drafts beyond this could only produce tokens past max_tokens or the context limit."""
        by_tokens = request.sampling_params.max_tokens - request.num_output_tokens - 1
        by_length = self.max_model_len - request.num_tokens - 1
        return max(0, min(by_tokens, by_length))

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int,
               lookahead: Callable[[Request], int] | None) -> tuple[int, int] | None:
        """Reserves blocks for the first chunk of a waiting request, reusing cached prefix blocks,
        and for drafts after it where it ends the prompt (`_drafts_after`). Returns the number
        of tokens to feed and of draft slots, or None when blocks are short."""
        cached_blocks = self.block_manager.find_cached_prefix(request)
        num_cached = len(cached_blocks) * self.block_manager.block_size
        request.num_computed_tokens = num_cached
        num_new = min(request.num_tokens - num_cached, budget)
        num_lookahead = self._draft_slots(request, num_new, budget, lookahead, False)
        if not self.block_manager.allocate(request, num_new + num_lookahead, cached_blocks):
            request.num_computed_tokens = 0
            return None
        request.num_cached_prompt_tokens = num_cached
        self.block_manager.record_prefix_lookup(request.num_tokens, num_cached)
        return num_new, num_lookahead

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0  # the blocks are gone for every KV pool
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput,
                           emitted_token_ids: list[list[int]]) -> list[Request]:
        """Advances each scheduled request by the tokens the step produced for it.

        `emitted_token_ids[i]` is empty when the step only prefilled part of a prompt; else the
        accepted drafts followed by one sampled token. Returns the requests that finished.
        """
        finished = []
        for scheduled, emitted in zip(out.scheduled, emitted_token_ids):
            request = scheduled.request
            if request.is_finished:
                continue
            num_drafts = len(request.draft_token_ids)
            num_accepted = max(len(emitted) - 1, 0) if num_drafts else 0
            request.num_computed_tokens += scheduled.num_new_tokens + num_accepted
            request.draft_token_ids = []
            if num_drafts:
                request.spec_stats.record(num_drafts, num_accepted)
                self.spec_stats.record(num_drafts, num_accepted)
                num_forced = sum(request.forced_drafts)
                num_forced_accepted = sum(request.forced_drafts[:num_accepted])
                if num_drafts > num_forced:
                    for stats in (request.spec_stats, self.spec_stats):
                        stats.record_method(request.draft_method, num_drafts - num_forced,
                                            num_accepted - num_forced_accepted)
                if num_forced:
                    # Forced drafts are accepted unless a guessed draft before them was not.
                    request.spec_stats.record_forced(num_forced, num_forced_accepted)
                    self.spec_stats.record_forced(num_forced, num_forced_accepted)
            status = None
            for token_id in emitted:
                request.append_output_token(token_id)
                status = self.stop_status(request, token_id)
                if status is not None:
                    break
            if status is not None:
                # Cached before the blocks are freed: a request that ends on its first step
                # (max_tokens=1) leaves its prompt for the next one as any other does. A stop
                # among accepted drafts cut the tokens short of what was computed.
                self.block_manager.cache_full_blocks(
                    request, min(request.num_computed_tokens, request.num_tokens))
                self.finish(request, status)
                finished.append(request)
                continue
            if scheduled.num_lookahead:
                self.block_manager.truncate(request, request.num_tokens)
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            self.block_manager.release_behind_window(request)
        return finished

    def stop_status(self, request: Request, token_id: int,
                    num_output_tokens: int | None = None) -> RequestStatus | None:
        """What `token_id` ends, as the `num_output_tokens`-th output token (default: the
        request's last)."""
        if num_output_tokens is None:
            num_output_tokens = request.num_output_tokens
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id  # as vLLM: set for stop tokens, None for EOS
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= params.max_tokens \
                or request.num_prompt_tokens + num_output_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus,
               num_output_tokens: int | None = None) -> None:
        """Ends a running request (a stop condition, or a stop string found by the caller, who
        may cut the output back to `num_output_tokens`)."""
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        if request in self.running:
            self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.block_manager.free(request)
