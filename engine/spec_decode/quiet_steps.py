"""Quiet steps: where a speculative engine drafts nothing, its next decode steps run as `none`'s
do, overlapped with the host (engine/runner/overlap.py). On by default on CUDA for a method whose
proposer can sit steps out (`ngram`, `suffix`, `auto` without a head), and on a CPU with
`--async-scheduling` (for tests: there the host computes the forward, nothing overlaps).

A speculative step builds its drafts from the tokens before it, so it waits for them: the host
reads step N's tokens before it can launch N+1. On a GPU that wait is the step's host time made
visible: on an H100 a synchronous `ngram` step took 1.97 ms where an overlapped `none` step took
1.54 (docs/gpu.md, 2026-11-28).

So after a synchronous step in which no request had drafts to verify (the controller planned
none, or the lookup found none), the engine may take a run of plain decode steps that overlap.
The run doubles with each such step in a row, 1, 2, 4, ... up to MAX_QUIET_RUN, and ends at the
first synchronous step that verifies drafts. A step whose drafts were all rejected does not
start a run: the controller has already lowered its estimate, and where it still plans drafts
(copying, whose drafts fail now and then) every step stays synchronous. Starting runs after
rejections too, an H100 gained 5-12% on chat and lost 18-32% on copy. A quiet step computes
exactly what a `none` step does, so speculation stays lossless: greedy tokens equal, and seeded
samples too (a row's generator is keyed by the output position it samples, in both kinds).

What a quiet run costs: drafts that would have been found during it. A copy that starts inside a
run is found at its end, at most MAX_QUIET_RUN tokens late. What the synchronous steps between
runs cost: each, and the call that lands a run's last step, costs more than a quiet step (on an
H100 1.97 and ~0.5 ms against 1.54), so runs of 16 kept a method that drafts nothing at ~1.035x
`none`'s time a token; runs of 32, reached after 31 quiet steps, keep it near 1.018x.
"""

from __future__ import annotations

MAX_QUIET_RUN = 32


class QuietSteps:
    def __init__(self, max_run: int = MAX_QUIET_RUN):
        self.max_run = max_run
        self.streak = 0  # synchronous decode steps in a row that verified no draft
        self.left = 0  # quiet steps the current run may still take
        self.num_taken = 0  # since start

    def observe(self, drafted_any: bool) -> None:
        """After a synchronous step with decode rows: whether any request had drafts verified."""
        if drafted_any or not self.max_run:
            self.streak, self.left = 0, 0
            return
        self.streak += 1
        self.left = min(1 << (self.streak - 1), self.max_run)

    @property
    def ready(self) -> bool:
        """Whether the next decode step may run quiet (and overlap)."""
        return self.left > 0

    def take(self) -> None:
        """A quiet step launched."""
        self.left -= 1
        self.num_taken += 1
