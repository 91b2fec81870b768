"""Overlapped decode steps (async scheduling): the host prepares and launches step N+1 while the
device still runs step N, as vLLM v1's async scheduler and SGLang's overlap scheduler do.

On a GPU a decode step's host work (schedule, build inputs, detokenize, emit) ran in series with
the device: an H100 profile of the default model showed ~0.45 ms of host time a step that
nothing hid (docs/gpu.md). Here a step:
1. schedules N+1 as if N's tokens were known: each request of N holds a placeholder token
   (PLACEHOLDER) at the output position N samples, so counts, positions and KV slots are right;
2. builds N+1's inputs; the placeholders' rows take N's sampled tokens on the device (the runner's
   `feed_in_flight`: the padded step gathers them from its `sampled` buffer, the flat step copies
   them in), so nothing waits for them;
3. launches N+1 (forward and sampling) and starts the copy of its tokens to the host;
4. only then reads N's tokens (the device has N+1 queued behind them), puts them in place of
   the placeholders, checks stop conditions and emits.

A stop found late (EOS, a stop token or string) has already been scheduled one token further:
that token is dropped when it lands (its request is finished), and the client never sees it.
Its KV writes land in blocks the request just freed; any later step that reuses those blocks
runs after it on the device's stream.

Which steps overlap: plain decode steps, where a token's value is not needed to build the next
step. Speculative steps (drafts are built from the tokens), grammars (the next mask follows the
token), penalties and logit bias (computed from the tokens), admissions (prefill) and steps that
could preempt fall back to a synchronous step after the step in flight lands. A speculative
engine whose drafts are not paying takes runs of quiet steps, plain decode steps that overlap
(engine/spec_decode/quiet_steps.py). Seeded sampling is the same as without overlap: each
row's generator is keyed by the output position it samples, and placeholders keep that position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.device import PendingRead
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.runner import runner_for
from engine.sample.nan_rows import nan_requests, zero_nan_rows
from engine.sample.verifier import sample_on_device

if TYPE_CHECKING:  # the engine's public output type, one level up
    from engine.outputs import RequestOutput

PLACEHOLDER = -1  # a sampled token not yet read back; never fed to the model as it is


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read."""

    plan: SchedulerOutput
    requests: list[Request]  # the step's sampling requests, one logits row each
    positions: list[int]  # per request, the output index its token fills
    row_starts: list[int]  # per request, its logits row
    logits: torch.Tensor  # kept for logprobs
    tokens: torch.Tensor  # [num_requests] on the device: what feeds the next step
    read: PendingRead  # the same tokens, then each logits row's NaN flag, on their way to the host


def uses_async_scheduling(setting: bool | None, device: torch.device,
                          speculative: bool = False, sits_out: bool = False) -> bool:
    """`--async-scheduling` as set; by default on CUDA (on a CPU the host computes the forward
    itself, so there is nothing to overlap) without speculation, or with a proposer that sits
    out steps (quiet_steps.py): where its drafts do not pay, its steps are then `none`'s, and
    the controller prices no draft at a quiet step's measured cost (step_periods.py). A
    proposer that must see every step (a draft model, a head) stays synchronous."""
    if setting is None:
        return device.type == "cuda" and (not speculative or sits_out)
    return setting


class OverlappedSteps:
    def __init__(self, engine):
        self.engine = engine
        self.in_flight: InFlight | None = None
        self.num_overlapped = 0  # steps launched before the previous one landed, since start

    @classmethod
    def for_engine(cls, engine) -> OverlappedSteps | None:
        """The engine's overlapped steps, or None where they are off (uses_async_scheduling).
        Asked for with a proposer that cannot sit steps out (quiet_steps.py), it is refused,
        not silently off."""
        speculation = engine.speculation
        if not uses_async_scheduling(engine.config.scheduler.async_scheduling, engine.device,
                                     speculative=speculation is not None,
                                     sits_out=speculation is not None
                                     and speculation.quiet is not None):
            return None
        if speculation is not None and speculation.quiet is None:
            raise ValueError(
                "--async-scheduling overlaps decode steps that draft nothing, which "
                f"--speculative-method {engine.proposer.name} cannot sit out (its draft model or "
                "head must see every step): pass --speculative-method ngram, suffix or none, or "
                "leave --async-scheduling to its default")
        return cls(engine)

    def step(self) -> list[RequestOutput] | None:
        """One overlapped step: launches the next step, then lands the one in flight and returns
        its outputs. None where the next step cannot overlap and nothing is in flight: the
        caller runs a synchronous step."""
        previous, self.in_flight = self.in_flight, None
        engine = self.engine
        periods = None if engine.speculation is None else engine.speculation.periods
        if periods is not None:  # what quiet steps cost, for the controller (step_periods.py)
            periods.start(time.perf_counter())
        if not self._applies():
            if previous is not None and periods is not None:
                periods.mark_landing()
            return None if previous is None else self._land(previous)
        if engine.speculation is not None:
            engine.speculation.quiet.take()
        engine._recorder.start()
        plan = engine.scheduler.schedule(None)
        if periods is not None:
            periods.mark_quiet(len(plan.scheduled))
        runner = runner_for(plan.scheduled, engine.runner, engine.static_runner)
        model_input = runner.prepare(plan.scheduled, self._in_flight_rows(plan, previous))
        if previous is not None:  # on the device: nothing waits for the tokens in flight
            runner.feed_in_flight(model_input, previous.tokens)
        requests = [plan.scheduled[i].request for i in model_input.logits_owners]
        row_starts = model_input.logits_row_starts
        _hidden, logits = runner.run(model_input)
        # As a synchronous step does (failures.verify_step): a request with a NaN row fails
        # alone, and where the batch samples the row is zeroed first, so sampling it cannot
        # draw an id past the vocabulary that the next step would feed the model.
        engine.faults.corrupt_logits(requests, row_starts, logits)
        all_greedy = all(r.sampling_params.greedy for r in requests)
        nan_flags = zero_nan_rows(logits, not all_greedy)
        tokens = runner.greedy_tokens(model_input, logits) if all_greedy else None
        if tokens is None:
            tokens = sample_on_device(requests, row_starts, logits, engine.generator)
        if any(r.sampling_params.logprobs is not None for r in requests):
            logits = logits.clone()  # it may be a graph's buffer, which the next step rewrites
        positions = []
        for request in requests:  # the step's token is in flight: hold its place
            positions.append(request.num_output_tokens)
            request.append_output_token(PLACEHOLDER)
            request.num_placeholder_tokens += 1
            request.num_computed_tokens += 1
        # the NaN flags travel in the tokens' copy: one wait for the device, not two
        read = PendingRead(torch.cat((tokens, nan_flags.device.to(tokens.dtype))))
        self.in_flight = InFlight(plan, requests, positions, row_starts, logits, tokens, read)
        if previous is not None:
            self.num_overlapped += 1
            return self._land(previous)
        return []

    def _applies(self) -> bool:
        """Whether the next step can be built without the tokens in flight: every running
        request decodes plainly (with speculation, in a quiet run), none is at its length
        limit, nobody waits to be admitted, and the free blocks hold every request's next token
        (so scheduling cannot preempt)."""
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        if scheduler.waiting or not scheduler.running:
            return False
        if engine.speculation is not None and not engine.speculation.quiet_step_ready():
            return False
        if len(scheduler.running) > engine.config.scheduler.max_num_batched_tokens:
            return False
        needed = 0
        for request in scheduler.running:
            params = request.sampling_params
            if (request.grammar is not None or params.needs_penalties or params.logit_bias
                    or request.num_tokens - request.num_computed_tokens != 1
                    or request.num_output_tokens >= params.max_tokens
                    or request.num_tokens >= engine.limits.max_model_len):
                return False
            needed += max(blocks.num_blocks_for(request.num_tokens) - len(request.block_table), 0)
        return needed <= blocks.num_free_blocks

    @staticmethod
    def _in_flight_rows(plan, previous: InFlight | None) -> dict[int, int]:
        """{id(request): its row in the step in flight} for each scheduled request that feeds
        the token in flight (a placeholder)."""
        if previous is None:
            return {}
        source = {id(request): i for i, request in enumerate(previous.requests)}
        return {id(s.request): source[id(s.request)] for s in plan.scheduled
                if s.request.all_token_ids[s.request.num_computed_tokens] == PLACEHOLDER}

    def _land(self, flight: InFlight) -> list[RequestOutput]:
        """Reads a step's tokens, puts them in place of their placeholders, finishes what they
        stop and emits them. Tokens of requests finished meanwhile (stopped by the token before,
        or aborted) are dropped."""
        engine = self.engine
        scheduler = engine.scheduler
        now = time.monotonic()
        outputs, latencies, num_prompt_tokens = [], [], 0
        landed = flight.read.result()
        tokens, row_is_nan = landed[:len(flight.requests)], landed[len(flight.requests):]
        failed = nan_requests(flight.requests, flight.row_starts, row_is_nan)
        for request, position, token, row_start in zip(
                flight.requests, flight.positions, tokens, flight.row_starts):
            if request.is_finished:
                continue
            if request.request_id in failed:  # its token is dropped, and the one after it
                request.truncate_output(position)
                engine._fail(request, failed[request.request_id])
                outputs.append(engine._emit(request, position, row_start, flight.logits, now,
                                            []))
                continue
            request.output_token_ids[position] = token
            request.all_token_ids[request.num_prompt_tokens + position] = token
            request.num_placeholder_tokens -= 1
            if request.last_token_time is not None:
                latencies.append(now - request.last_token_time)
            elif request.first_token_time is None:
                num_prompt_tokens += request.num_prompt_tokens
            status = scheduler.stop_status(request, token, position + 1)
            if status is not None:  # the tokens scheduled past it are dropped
                scheduler.finish(request, status, num_output_tokens=position + 1)
            else:
                engine.block_manager.cache_full_blocks(request, request.num_computed_tokens)
                engine.block_manager.release_behind_window(request)
            outputs.append(engine._emit(request, position, row_start, flight.logits, now,
                                        [token]))
        engine._report_step(flight.plan, num_prompt_tokens, outputs, latencies)
        return outputs

