"""How long the event loop was held: a task that asks to wake every `interval_s` and records how
late it woke. Everything the server answers (`/health` included) runs on that loop, so a late
wake-up is time in which no request could be read or answered: a body parsed on the loop, a
callback that blocked, or the engine thread holding the GIL. Exported as the histogram
`<prefix>:event_loop_lag_seconds` (the soak run reads it, `specserve bench serve --duration`);
its target is that no observation passes 50 ms (issue 48). Also here: freezing the start-up
objects out of the garbage collector, whose full collections were what the soak saw holding the
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time

from prometheus_client import CollectorRegistry, Histogram

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FREEZE_ENV = "SPECSERVE_GC_FREEZE"  # "0": leave the collector as Python sets it up


def freeze_startup_objects() -> bool:
    """Moves every object alive after start-up (the model's Python objects, the tokenizer, the
    templates, the libraries: hundreds of thousands, alive as long as the process) out of the
    garbage collector's view, as vLLM does after its start-up. A full collection then scans only
    what requests allocated since, instead of everything: under load, full collections held the
    event loop (and every thread) for 100-250 ms about every 10 s (the soak's lag histogram)."""
    if os.environ.get(FREEZE_ENV) == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


class LoopLagMonitor:
    """`start()` on the running loop, `await stop()` at shutdown."""

    def __init__(self, registry: CollectorRegistry, prefix: str, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.histogram = Histogram(
            f"{prefix}:event_loop_lag_seconds", "How late the event loop woke a task that slept "
            f"{interval_s * 1000:.0f} ms: time in which no request could be served",
            registry=registry, buckets=LAG_BUCKETS_S)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _watch(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.perf_counter() - asked - self.interval_s))
