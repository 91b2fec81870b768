"""Continuous batching: which requests run this step, with how many tokens each.

Every step is a flat batch of tokens under a token budget. Running requests go first, oldest first,
so decodes are never starved by a long prompt; a prompt longer than what is left of the budget is
prefilled in chunks over several steps. When KV blocks run out, the newest running request is
preempted: its blocks are freed and it is later recomputed from its tokens (prompt and output so
far), which gives the same output because sampling depends only on the request's own history.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # fed to the model this step, starting at request.num_computed_tokens
    samples_token: bool  # the step reaches the request's last token, so it yields the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

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
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_or_preempt(request, num_new, out):
                break  # the request itself was the newest and got preempted
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        # New requests only when nobody had to give up blocks this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = self._admit(request, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return out

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        reaches_end = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, samples_token=reaches_end)

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int) -> int | None:
        """Reserves blocks for the first chunk of a waiting request, reusing cached prefix blocks.
        Returns the number of tokens to feed, or None when blocks are short."""
        cached_blocks = self.block_manager.find_cached_prefix(request)
        num_cached = len(cached_blocks) * self.block_manager.block_size
        request.num_computed_tokens = num_cached
        num_new = min(request.num_tokens - num_cached, budget)
        if not self.block_manager.allocate(request, num_new, cached_blocks):
            request.num_computed_tokens = 0
            return None
        request.num_cached_prompt_tokens = num_cached
        self.block_manager.record_prefix_lookup(request.num_tokens, num_cached)
        return num_new

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: list[int | None]) -> list[Request]:
        """Advances each scheduled request by its computed tokens and its new token (None when
        the step only prefilled part of a prompt). Returns the requests that finished."""
        finished = []
        for scheduled, token_id in zip(out.scheduled, sampled_token_ids):
            request = scheduled.request
            if request.is_finished:
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id  # as vLLM: set for stop tokens, None for EOS
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens \
                or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a running request (a stop condition, or a stop string found by the caller)."""
        if request in self.running:
            self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.block_manager.free(request)
