"""Where structured-output specs are checked and compiled: worker threads, never the event loop,
in two lanes, under one time limit.

JSON-schema validation (pure Python) and grammar compilation (llguidance, which drops the GIL)
can take a second for a spec near the size limit. Each runs on a worker thread, so the event loop
keeps answering `/health` and streaming; llguidance's parser limits and the spec limits in
`server/structured.py` bound the work of each, and its memory (the lexer's states).

Lanes: a spec is weighed on the loop in bounded time (its nodes and characters, counted up to
`SMALL_SPEC_WEIGHT`); small specs, nearly all of them, have their own workers, so a few huge
schemas queued in the large lane never starve them. A request waits at most `timeout_s` from
submission; one that has not started by then is cancelled and never runs, one that has started
stops at its next probe step (the compiler checks the deadline), and the request gets a 400.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

SMALL_SPEC_WEIGHT = 4_000  # nodes + characters of a spec that still counts as small
SMALL_LANE_WORKERS = 2
LARGE_LANE_WORKERS = 1
DEFAULT_TIMEOUT_S = 5.0


class GateTimeout(Exception):
    """The work did not finish within the gate's time limit."""


class GrammarGate:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._small = ThreadPoolExecutor(SMALL_LANE_WORKERS, "grammar-small")
        self._large = ThreadPoolExecutor(LARGE_LANE_WORKERS, "grammar-large")

    async def run(self, work: Callable[[float], T], large: bool) -> T:
        """`work(deadline)` (a time.monotonic() deadline it may check) on a worker of its lane;
        raises what it raised, or GateTimeout."""
        deadline = time.monotonic() + self.timeout_s
        future = (self._large if large else self._small).submit(work, deadline)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            future.cancel()  # queued and not started: it never runs
            raise GateTimeout() from None

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def close(self) -> None:
        for executor in (self._small, self._large):
            executor.shutdown(wait=False, cancel_futures=True)


def is_large(values, limit: int = SMALL_SPEC_WEIGHT) -> bool:
    """Whether JSON-like `values` weigh at least `limit` (a node counts 1, a string its length),
    counted only that far: bounded work on the event loop whatever their size."""
    weight, stack = 0, list(values)
    while stack and weight < limit:
        value = stack.pop()
        if isinstance(value, str):
            weight += len(value)
        elif isinstance(value, dict):
            weight += len(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            weight += len(value)
            stack.extend(value)
        else:
            weight += 1
    return weight >= limit
