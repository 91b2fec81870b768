"""What the engine observed, as plain data: one `StepStats` per step, one `RequestStats` per
finished request. `engine/metrics/prometheus.py` turns them into Prometheus metrics; the periodic log line
reads them too. Nothing here knows about Prometheus."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.metrics.spec_stats import SpecStats


@dataclass
class StepStats:
    num_batched_tokens: int  # tokens fed to the target this step (drafts included)
    step_seconds: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_prompt_tokens: int  # prompts of the requests that got their first token this step
    num_generated_tokens: int  # tokens emitted to requests this step
    num_preemptions: int  # this step
    prefix_cache_queries: int  # this step, in tokens
    prefix_cache_hits: int
    spec: SpecStats = field(default_factory=SpecStats)  # this step's verifications
    num_speculating: int = 0  # requests that carried drafts this step
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, per request emit

    @property
    def current_k(self) -> float:
        """Mean draft tokens per speculating request this step."""
        return self.spec.num_draft_tokens / self.num_speculating if self.num_speculating else 0.0


def span(start: float | None, end: float | None) -> float | None:
    """`end - start` in seconds (never negative), or None when either stamp is missing."""
    return None if start is None or end is None else max(end - start, 0.0)


@dataclass
class RequestStats:
    """A finished request's spans in seconds, from its timestamps (engine/core/request.py). None
    where a stamp is missing: no front stamps offline, no first token for a request that ended
    before it had one."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_seconds: float | None  # handed to the engine (or arrival) -> first scheduled
    prefill_seconds: float | None  # first scheduled -> first token
    decode_seconds: float | None  # first token -> finished
    e2e_seconds: float
    time_to_first_token: float | None  # arrival (the HTTP route's entry when served) -> first token
    spec: SpecStats
    front_seconds: float | None = None  # arrival -> handed to the engine (parse, template, ...)
    render_seconds: float | None = None  # arrival -> chat template rendered
    tokenize_seconds: float | None = None  # rendered (or arrival) -> tokenized
    inference_seconds: float | None = None  # first scheduled -> finished

    @property
    def time_per_output_token(self) -> float | None:
        if self.decode_seconds is None or self.num_generation_tokens < 2:
            return None
        return self.decode_seconds / (self.num_generation_tokens - 1)


def request_stats(request) -> RequestStats:
    """Summarises a finished request from its timestamps (time.monotonic seconds)."""
    return RequestStats(
        finish_reason=request.status.value,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        queue_seconds=span(request.queued_time or request.arrival_time,
                           request.first_scheduled_time),
        prefill_seconds=span(request.first_scheduled_time, request.first_token_time),
        decode_seconds=span(request.first_token_time, request.finished_time),
        e2e_seconds=span(request.arrival_time, request.finished_time) or 0.0,
        time_to_first_token=span(request.arrival_time, request.first_token_time),
        spec=request.spec_stats,
        front_seconds=span(request.arrival_time, request.queued_time),
        render_seconds=span(request.arrival_time, request.rendered_time),
        tokenize_seconds=span(request.rendered_time or request.arrival_time,
                              request.tokenized_time),
        inference_seconds=span(request.first_scheduled_time, request.finished_time),
    )


@dataclass
class DeliveryStats:
    """What only the server sees: when a request's tokens reached its client's socket. Taken
    after its response is written, when the engine is done with it."""

    first_token_write_delay: float | None  # first token sampled -> its bytes written
    last_token_write_delay: float | None  # last token sampled -> its bytes written
    time_to_first_token_written: float | None  # arrival -> the first token's bytes written
    # The server's share of its TTFT: arrival -> first token written, less the prefill (first
    # scheduled -> first token). What a client waits for beyond the engine's own work.
    first_token_overhead: float | None


def delivery_stats(request, first_written: float | None,
                   last_written: float | None) -> DeliveryStats:
    """`first_written` / `last_written`: time.monotonic when the bytes of the request's first
    / last token were written (None: never, e.g. a client that left first)."""
    to_first_written = span(request.arrival_time, first_written)
    prefill = span(request.first_scheduled_time, request.first_token_time)
    return DeliveryStats(
        first_token_write_delay=span(request.first_token_time, first_written),
        last_token_write_delay=span(request.last_token_time, last_written),
        time_to_first_token_written=to_first_written,
        first_token_overhead=(None if to_first_written is None or prefill is None
                              else max(to_first_written - prefill, 0.0)),
    )


def _difference(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: value - before.get(key, 0) for key, value in now.items()
            if value != before.get(key, 0)}


class StepRecorder:
    """Snapshots the engine's running counters when a step starts and reports the differences
    when it ends, so the scheduler and block manager keep plain cumulative counters."""

    def __init__(self, scheduler, block_manager):
        self.scheduler = scheduler
        self.block_manager = block_manager

    def start(self) -> None:
        """Before scheduling: admissions and preemptions happen inside `schedule()`."""
        self._started = time.perf_counter()
        self._preemptions = self.scheduler.num_preemptions
        prefix = self.block_manager.prefix_stats
        self._prefix = (prefix.queries, prefix.hits)
        self._spec = self.scheduler.spec_stats.snapshot()

    def finish(self, plan, num_prompt_tokens: int, num_generated_tokens: int,
               inter_token_latencies: list[float]) -> StepStats:
        prefix = self.block_manager.prefix_stats
        spec = self.scheduler.spec_stats
        before = self._spec
        step_spec = SpecStats(
            num_drafts=spec.num_drafts - before.num_drafts,
            num_draft_tokens=spec.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens - before.num_accepted_tokens,
            num_emitted_tokens=spec.num_emitted_tokens - before.num_emitted_tokens,
            num_forced_draft_tokens=spec.num_forced_draft_tokens - before.num_forced_draft_tokens,
            num_forced_accepted_tokens=(spec.num_forced_accepted_tokens
                                        - before.num_forced_accepted_tokens),
            draft_tokens_by_method=_difference(spec.draft_tokens_by_method,
                                               before.draft_tokens_by_method),
            accepted_tokens_by_method=_difference(spec.accepted_tokens_by_method,
                                                  before.accepted_tokens_by_method),
            accepted_per_position=[
                count - (before.accepted_per_position[i]
                         if i < len(before.accepted_per_position) else 0)
                for i, count in enumerate(spec.accepted_per_position)],
        )
        return StepStats(
            num_batched_tokens=plan.num_batched_tokens,
            step_seconds=time.perf_counter() - self._started,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions - self._preemptions,
            prefix_cache_queries=prefix.queries - self._prefix[0],
            prefix_cache_hits=prefix.hits - self._prefix[1],
            spec=step_spec,
            num_speculating=step_spec.num_drafts,
            inter_token_latencies=inter_token_latencies,
        )
