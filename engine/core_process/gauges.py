"""What the front reads about the engine process at any moment, without asking it: a few numbers
in shared memory that the engine process writes after every step and command.

A probe or a scrape then costs a memory read, never a round trip to a process that may be in the
middle of a long step (or wedged: `/health` must still answer). Each slot is one aligned double,
written and read whole; a reader may see one slot from before a step and another from after it,
which a gauge tolerates.
"""

from __future__ import annotations

import multiprocessing

_STEP_STARTED, _RUNNING, _WAITING, _USAGE, _FREE_BLOCKS, _NUM_BLOCKS, _BUSY = range(7)


class SharedGauges:
    """Created by the front before it starts the engine process (which inherits it)."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self._slots = context.RawArray("d", 7)

    # ------------------------------------------------------------ engine process
    def step_started(self, monotonic_time: float | None) -> None:
        """The step now running began at `monotonic_time` (None: no step runs)."""
        self._slots[_STEP_STARTED] = 0.0 if monotonic_time is None else monotonic_time

    def publish(self, num_running: int, num_waiting: int, kv_usage: float, num_free_blocks: int,
                num_blocks: int, busy: bool) -> None:
        slots = self._slots
        slots[_RUNNING], slots[_WAITING], slots[_USAGE] = num_running, num_waiting, kv_usage
        slots[_FREE_BLOCKS], slots[_NUM_BLOCKS] = num_free_blocks, num_blocks
        slots[_BUSY] = float(busy)

    # ---------------------------------------------------------------------- front
    @property
    def step_started_at(self) -> float | None:
        started = self._slots[_STEP_STARTED]
        return None if started == 0.0 else started

    def load(self) -> tuple[int, int, float]:
        """(running requests, waiting requests, share of KV blocks in use)."""
        return int(self._slots[_RUNNING]), int(self._slots[_WAITING]), self._slots[_USAGE]

    def kv_blocks(self) -> tuple[int, int]:
        """(free or evictable KV blocks, all KV blocks)."""
        return int(self._slots[_FREE_BLOCKS]), int(self._slots[_NUM_BLOCKS])

    def is_idle(self) -> bool:
        return not self._slots[_BUSY] and self._slots[_USAGE] == 0.0
