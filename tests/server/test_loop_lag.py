"""The event-loop lag monitor (server/loop_lag.py) sees a loop that a callback held, and nothing
on a free loop; the start-up objects are frozen out of the collector unless switched off."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry, generate_latest

from server.loop_lag import FREEZE_ENV, LoopLagMonitor, freeze_startup_objects
from specserve.bench.server_state import loop_lag_buckets


def _lags_over(registry: CollectorRegistry, bound: float) -> float:
    buckets = loop_lag_buckets(generate_latest(registry).decode())  # as the soak reads /metrics
    return buckets[float("inf")] - buckets[bound]


def _watch(hold_s: float) -> CollectorRegistry:
    registry = CollectorRegistry()

    async def scenario():
        monitor = LoopLagMonitor(registry, "t", interval_s=0.01)
        monitor.start()
        await asyncio.sleep(0.1)
        if hold_s:
            time.sleep(hold_s)  # a callback that blocks the loop, as a body parsed on it would
        await asyncio.sleep(0.1)
        await monitor.stop()

    asyncio.run(scenario())
    return registry


def test_a_held_loop_is_seen():
    assert _lags_over(_watch(0.3), 0.25) == 1


def test_a_free_loop_shows_no_lag():  # the negative control
    assert _lags_over(_watch(0.0), 0.1) == 0


def test_startup_objects_are_frozen_unless_switched_off(monkeypatch):
    try:
        monkeypatch.setenv(FREEZE_ENV, "0")
        assert not freeze_startup_objects() and gc.get_freeze_count() == 0
        monkeypatch.delenv(FREEZE_ENV)
        assert freeze_startup_objects() and gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
