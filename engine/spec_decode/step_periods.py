"""What a decode step takes from start to next start, by kind: the price of drafting nothing.

The controller (controller.py) prices a plan from the target's forward time (step_cost.py). That
is the whole story where every step is synchronous. With quiet steps (quiet_steps.py) a plan of
no draft leads to plain decode steps that overlap with the host, as `none`'s do, and those cost
less than a synchronous step: on an H100 an overlapped `none` step took 1.54 ms where a
synchronous `ngram` step took 1.97 (docs/gpu-2026-11-28.md). Priced as a synchronous step, no
draft looked dearer than it is, and drafts accepted 11-15% of the time (`ngram` on code) went
out and lost to `none` (0.89x on an H200, issue 71).

So where the engine takes quiet steps, it measures, per batch size:
- a quiet step's period: the wall time from one overlapped launch to the next, with the call
  that lands a run's last step counted into the run;
- a synchronous decode step's host time: its period less the forward and verification the
  step-cost fit already prices.
`no_draft_price` gives both once each is measured; until then the controller prices as before.
Periods are start to next start of `LLMEngine.step`, so the engine loop's own work between
steps is in both kinds alike.
"""

from __future__ import annotations

from dataclasses import dataclass

# Floor of a step's price: a fitted line may have no fixed part (step_cost.py), and a step
# whose every decoding request feeds its prompt's last chunk has no decode rows to price, so its
# no-draft price came out 0 and the plan divided by it (ZeroDivisionError, seen in a test).
MIN_STEP_SECONDS = 1e-6
PERIOD_DECAY = 0.9  # weight of the estimate so far, per observation
MIN_OBSERVATIONS = 4  # of each kind, at a batch size, before the price is used


@dataclass(frozen=True)
class NoDraftPrice:
    """Seconds a step of quiet decoding takes (per token a request), and the host time a
    synchronous step takes beyond its priced forward."""

    quiet_seconds: float
    sync_overhead: float


class _Average:
    def __init__(self):
        self.value, self.count = 0.0, 0

    def add(self, seconds: float) -> None:
        self.count += 1
        weight = PERIOD_DECAY if self.count > 1 else 0.0  # the first sets it
        self.value = weight * self.value + (1 - weight) * seconds


def batch_bucket(num_requests: int) -> int:
    """The power of two at or above a batch's size: steps of 9 to 16 requests share a price."""
    return 1 << max(num_requests - 1, 0).bit_length()


class StepPeriods:
    def __init__(self):
        self._quiet: dict[int, _Average] = {}
        self._overhead: dict[int, _Average] = {}
        self._last_start: float | None = None
        self._pending: tuple[str, int, float] | None = None  # the running step's kind
        self._run_seconds, self._run_steps, self._run_batch = 0.0, 0, 0

    def start(self, now: float) -> None:
        """A step starts: the one before it ends, and its period is attributed to its kind."""
        if self._last_start is not None and self._pending is not None:
            self._attribute(now - self._last_start, *self._pending)
        self._last_start, self._pending = now, None

    def mark_quiet(self, num_requests: int) -> None:
        """The running step launched a quiet (overlapped) decode step."""
        self._pending = ("quiet", num_requests, 0.0)

    def mark_landing(self) -> None:
        """The running step only lands the quiet run's last step."""
        self._pending = ("landing", self._run_batch, 0.0)

    def mark_sync(self, num_requests: int, priced_seconds: float) -> None:
        """The running step is a synchronous decode step whose forward and verification took
        `priced_seconds`."""
        self._pending = ("sync", num_requests, priced_seconds)

    def no_draft_price(self, num_requests: int) -> NoDraftPrice | None:
        bucket = batch_bucket(num_requests)
        quiet, overhead = self._quiet.get(bucket), self._overhead.get(bucket)
        if quiet is None or overhead is None or min(quiet.count, overhead.count) \
                < MIN_OBSERVATIONS:
            return None
        return NoDraftPrice(quiet.value, overhead.value)

    def _attribute(self, seconds: float, kind: str, num_requests: int, priced: float) -> None:
        if kind == "quiet":
            if self._run_steps and batch_bucket(num_requests) != batch_bucket(self._run_batch):
                self._close_run()
            self._run_seconds += seconds
            self._run_steps += 1
            self._run_batch = num_requests
            return
        if kind == "landing":
            self._run_seconds += seconds
        self._close_run()
        if kind == "sync":
            average = self._overhead.setdefault(batch_bucket(num_requests), _Average())
            average.add(max(seconds - priced, 0.0))

    def _close_run(self) -> None:
        if self._run_steps:
            average = self._quiet.setdefault(batch_bucket(self._run_batch), _Average())
            average.add(self._run_seconds / self._run_steps)
        self._run_seconds, self._run_steps = 0.0, 0


def no_draft_seconds(price: NoDraftPrice | None, synchronous_seconds: float) -> float:
    """What a step of no draft costs: a quiet step's period where measured, else the
    synchronous step's priced time; never less than MIN_STEP_SECONDS."""
    return max(synchronous_seconds if price is None else price.quiet_seconds, MIN_STEP_SECONDS)


def host_seconds(price: NoDraftPrice | None) -> float:
    """What a synchronous step, the only kind that verifies drafts, adds beyond its forward
    where no draft would have run quiet (0 where quiet steps are not measured), and the floor
    that keeps a step's price above 0."""
    return MIN_STEP_SECONDS if price is None else price.sync_overhead + MIN_STEP_SECONDS
