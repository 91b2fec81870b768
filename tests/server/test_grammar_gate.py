"""The structured-output workers (server/grammar_gate.py), without a server: a spec is weighed in
bounded time; small specs are not starved by large ones queued before them; a job that waits past
the time limit is cancelled and never runs. Each with its negative control."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from server.grammar_gate import GateTimeout, GrammarGate, is_large


def test_weighing_is_bounded_whatever_the_size():
    huge = {"properties": {f"p{i}": {"type": "string"} for i in range(200_000)}}
    started = time.monotonic()
    assert is_large([huge])
    assert time.monotonic() - started < 0.5
    assert not is_large([{"type": "object", "properties": {"a": {"type": "string"}}}])
    assert is_large(["x" * 10_000]) and not is_large(["x" * 10])


def _sleeper(seconds: float, ran: list | None = None):
    def work(_deadline: float) -> str:
        if ran is not None:
            ran.append(True)
        time.sleep(seconds)
        return "done"
    return work


def test_small_specs_pass_large_ones_queued_before_them():
    async def main():
        gate = GrammarGate(timeout_s=10)
        try:
            large = [asyncio.create_task(gate.run(_sleeper(1.0), large=True)) for _ in range(3)]
            await asyncio.sleep(0.05)
            started = time.monotonic()
            assert await gate.run(_sleeper(0.0), large=False) == "done"
            small_wait = time.monotonic() - started
            started = time.monotonic()
            await gate.run(_sleeper(0.0), large=True)  # control: behind the large ones
            large_wait = time.monotonic() - started
            await asyncio.gather(*large)
            return small_wait, large_wait
        finally:
            gate.close()

    small_wait, large_wait = asyncio.run(main())
    assert small_wait < 0.5 and large_wait > 2.0, (small_wait, large_wait)


def test_a_job_waiting_past_the_limit_is_cancelled_unrun():
    async def main():
        gate = GrammarGate(timeout_s=0.5)
        ran: list = []
        try:
            busy = asyncio.create_task(gate.run(_sleeper(1.5), large=True))
            await asyncio.sleep(0.05)
            with pytest.raises(GateTimeout):
                await gate.run(_sleeper(0.0, ran), large=True)
            with pytest.raises(GateTimeout):
                await busy  # started, ran past the limit: the request is answered anyway
            await asyncio.sleep(1.5)
            return ran
        finally:
            gate.close()

    assert asyncio.run(main()) == []
    assert threading.active_count() < 50
