"""StallWatch (server/streaming.py): one timer per stream gives what `asyncio.timeout` around each
send gave: a send stuck for the timeout raises TimeoutError, sends that each finish in time never
do however long the stream runs, and a cancel from elsewhere stays a cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.streaming import StallWatch

TIMEOUT_S = 0.2


async def _quick(message) -> None:
    await asyncio.sleep(TIMEOUT_S / 10)


async def _stuck(message) -> None:
    await asyncio.Event().wait()


def test_a_stuck_send_times_out_at_its_own_deadline():
    async def run() -> float:
        watch = StallWatch(_stuck, TIMEOUT_S)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await watch.send("x")
        watch.close()
        return time.monotonic() - start

    waited = asyncio.run(run())
    assert TIMEOUT_S <= waited < TIMEOUT_S + 0.15


def test_sends_that_each_finish_in_time_never_time_out():
    """Many timeout periods of sends, each short: the timer re-arms for the send in flight."""
    async def run() -> int:
        watch = StallWatch(_quick, TIMEOUT_S)
        sent = 0
        deadline = time.monotonic() + TIMEOUT_S * 5
        while time.monotonic() < deadline:
            await watch.send(sent)
            sent += 1
        watch.close()
        return sent

    assert asyncio.run(run()) > 20


def test_a_send_stuck_after_quick_ones_times_out_from_its_own_start():
    calls = []

    async def quick_then_stuck(message) -> None:
        calls.append(time.monotonic())
        await (_stuck(message) if message == "last" else _quick(message))

    async def run() -> float:
        watch = StallWatch(quick_then_stuck, TIMEOUT_S)
        for i in range(15):  # past one timeout period: the first timer has fired and re-armed
            await watch.send(i)
        with pytest.raises(TimeoutError):
            await watch.send("last")
        watch.close()
        return time.monotonic() - calls[-1]

    assert TIMEOUT_S <= asyncio.run(run()) < TIMEOUT_S + 0.15


def test_a_cancel_from_elsewhere_stays_a_cancel_and_no_timeout_set_never_fires():
    async def run() -> None:
        task = asyncio.create_task(StallWatch(_stuck, TIMEOUT_S).send("x"))
        await asyncio.sleep(TIMEOUT_S / 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        unwatched = asyncio.create_task(StallWatch(_stuck, None).send("x"))
        await asyncio.sleep(TIMEOUT_S * 2)
        assert not unwatched.done()
        unwatched.cancel()

    asyncio.run(run())
