"""Quiet steps: where speculation is not paying, a speculative engine's next decode steps run as
`none`'s do, overlapped with the host (engine/runner/overlap.py).

A speculative step builds its drafts from the tokens before it, so it waits for them: the host
reads step N's tokens before it can launch N+1. On a GPU that wait is the step's host time made
visible. On an H100 (docs/gpu.md, 2026-11-27) `ngram` drafted 5 tokens in 128 on a chat prompt,
none of them accepted, and ran at 0.76x `none`, whose decode steps overlap.

So after a synchronous step in which no request had a draft accepted (the controller planned
none, the lookup found none, or the target refused them), the engine may take a run of plain
decode steps that overlap. The run doubles with each such step in a row, 1, 2, 4, ... up to
MAX_QUIET_RUN, and ends at the first synchronous step that accepts a draft. At most one step in
MAX_QUIET_RUN + 1 then looks for drafts on traffic where they fail; where they succeed (copying),
every step stays synchronous, as before. A quiet step computes exactly what a `none` step does,
so speculation stays lossless: greedy tokens equal, and seeded samples too (a row's generator is
keyed by the output position it samples, in both kinds of step).

What a quiet run costs: drafts that would have been found during it. A copy that starts inside a
run is found at its end, at most MAX_QUIET_RUN tokens late.
"""

from __future__ import annotations

MAX_QUIET_RUN = 16


class QuietSteps:
    def __init__(self, max_run: int = MAX_QUIET_RUN):
        self.max_run = max_run
        self.streak = 0  # synchronous decode steps in a row that accepted no draft
        self.left = 0  # quiet steps the current run may still take
        self.num_taken = 0  # since start

    def observe(self, accepted_any: bool) -> None:
        """After a synchronous step with decode rows: whether any request had a draft accepted."""
        if accepted_any or not self.max_run:
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
