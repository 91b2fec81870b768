"""The chat-template pool's size (server/templates.py): it starts with one renderer and grows,
up to `--chat-template-workers`, only while renderings wait for one; a killed renderer is replaced
only when it was the last; close() kills one still starting."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from server.errors import APIError
from server.templates import ChatTemplates, TemplateLimitError, TemplateLimits
from tests.server.test_chat_templates import HOSTILE_TEMPLATE, PLAIN, PLAIN_TEXT, SPIN, _run

def _live_renderers() -> set[int]:
    """The pids of this process's template workers that are alive (zombies not counted), read
    from /proc rather than from the pool's own bookkeeping."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmd:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
                command = cmd.read()
        except OSError:  # exited meanwhile
            continue
        if int(parent) == os.getpid() and state != "Z" and b"server.template_worker" in command:
            pids.add(int(entry))
    return pids


def test_the_pool_starts_with_one_renderer():
    """Each renderer is ~22 MB resident: one at start, whatever `workers` says. The control: the
    same count sees a second pool's renderer, and none once both are closed."""
    async def count():
        pools = [ChatTemplates({}, TemplateLimits(workers=2)) for _ in range(2)]
        await pools[0].start()
        one_pool = _live_renderers(), {renderer.process.pid for renderer in pools[0]._all}
        await pools[1].start()
        two_pools = _live_renderers()
        for pool in pools:
            await pool.close()
        return one_pool, two_pools, _live_renderers()

    (one_pool, in_the_pool), two_pools, closed = asyncio.run(count())
    assert len(one_pool) == 1 and one_pool == in_the_pool
    assert len(two_pools) == 2 and one_pool < two_pools
    assert closed == set()


def _grow_past_a_spin(limits: TemplateLimits, num_plain: int):
    """A spinning rendering takes the first renderer, then `num_plain` plain ones are asked for:
    how long each took, the most renderers alive (counted in /proc and by the pool, starting ones
    included) and whether `/ready` would have failed, sampled until they are served and 0.3 s
    more."""
    async def spin_then_plain(pool):
        spin = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, SPIN, None, True))
        await asyncio.sleep(0.3)
        assert len(pool._all) == 1 and not pool._starting  # no growth before anyone waits
        started = time.monotonic()

        async def plain():
            text = await pool.render(HOSTILE_TEMPLATE, PLAIN, None, True)
            return text, time.monotonic() - started

        plains = asyncio.gather(*(plain() for _ in range(num_plain)))
        most, saturated, samples_after = 0, False, 15
        while samples_after:
            most = max(most, len(_live_renderers()), len(pool._all) + len(pool._starting))
            saturated = saturated or pool.saturated
            samples_after -= plains.done()
            await asyncio.sleep(0.02)
        if spin.done():  # stopped by its timeout
            assert isinstance(spin.exception(), TemplateLimitError)
        spin.cancel()
        return await plains, most, saturated

    return _run(spin_then_plain, limits)


@pytest.mark.parametrize("workers, num_plain, most_expected", [(2, 4, 2), (3, 1, 2)])
def test_a_stuck_renderer_makes_the_pool_grow_up_to_its_limit(workers, num_plain,
                                                              most_expected):
    """Grown by one renderer and no further: at the limit though four wait, or for the one that
    waits though the limit is higher. `/ready` fails only once the pool cannot grow: never with
    room for a third renderer."""
    limits = TemplateLimits(timeout_s=6.0, workers=workers)
    plains, most, saturated = _grow_past_a_spin(limits, num_plain)
    assert [text for text, _ in plains] == [PLAIN_TEXT] * num_plain
    assert max(seconds for _, seconds in plains) < limits.timeout_s / 2  # not after the spin
    assert most == most_expected
    if workers == 3:
        assert not saturated


def test_a_pool_at_its_limit_makes_renderings_wait_for_a_stuck_one():
    """The control of the test above: with one renderer allowed, the plain rendering waits for
    the spin to be stopped, and `/ready` fails meanwhile."""
    limits = TemplateLimits(timeout_s=2.0, workers=1)
    plains, most, saturated = _grow_past_a_spin(limits, num_plain=1)
    assert plains[0][0] == PLAIN_TEXT and plains[0][1] >= limits.timeout_s - 0.5
    assert most == 1 and saturated


def test_a_killed_renderer_is_replaced_only_when_it_was_the_last():
    async def kill_twice(pool):
        spin = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, SPIN, None, True))
        await asyncio.sleep(0.3)
        assert await pool.render(HOSTILE_TEMPLATE, PLAIN, None, True) == PLAIN_TEXT  # grown
        both = _live_renderers()
        with pytest.raises(TemplateLimitError):
            await spin
        not_replaced = len(pool._all), len(pool._starting)
        await asyncio.sleep(1.0)
        survivor = _live_renderers()
        with pytest.raises(TemplateLimitError):  # on the survivor, the last renderer
            await pool.render(HOSTILE_TEMPLATE, SPIN, None, True)
        replaced = len(pool._all), len(pool._starting)
        assert await pool.render(HOSTILE_TEMPLATE, PLAIN, None, True) == PLAIN_TEXT
        return both, not_replaced, survivor, replaced, _live_renderers()

    both, not_replaced, survivor, replaced, replacement = _run(
        kill_twice, TemplateLimits(timeout_s=1.0, workers=2))
    assert len(both) == 2 and not_replaced == (1, 0)
    assert len(survivor) == 1 and survivor < both
    assert replaced == (0, 1)  # the control: the last one is replaced at once
    assert len(replacement) == 1 and not replacement & both


def test_close_kills_a_renderer_still_starting(monkeypatch):
    """Renderers after the first start slowly here (5 s before the worker's own start), so the
    one grown for the plain rendering is still starting when the pool closes."""
    create_subprocess_exec = asyncio.create_subprocess_exec
    slow_start = ("import runpy, time; time.sleep(5); "
                  "runpy.run_module('server.template_worker', run_name='__main__')")

    async def slow_after_the_first(program, *args, **kwargs):
        if _live_renderers():
            args = ("-c", slow_start)
        return await create_subprocess_exec(program, *args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_after_the_first)

    async def close_while_growing(pool):
        spin = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, SPIN, None, True))
        plain = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, PLAIN, None, True))
        while len(growing := _live_renderers()) < 2:
            await asyncio.sleep(0.01)
        still_starting = bool(pool._starting)
        started = time.monotonic()
        await pool.close()
        closed_in = time.monotonic() - started
        results = await asyncio.gather(spin, plain, return_exceptions=True)
        return growing, still_starting, closed_in, results, _live_renderers()

    growing, still_starting, closed_in, results, after = _run(
        close_while_growing, TemplateLimits(timeout_s=30, workers=2))
    assert len(growing) == 2 and still_starting  # the control: a starting child to be killed
    assert after == set() and closed_in < 2.0  # killed, not waited for
    assert all(isinstance(result, APIError) and result.status_code == 503 for result in results)
