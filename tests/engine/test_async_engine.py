"""AsyncEngine: streaming from a background step loop, abort from the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import TEST_DEVICE, TEST_KV_CACHE_GIB


@pytest.fixture(scope="module")
def async_engine(tiny_chat_model_folder):
    engine = AsyncEngine.from_config(EngineConfig.from_kwargs(
        model=str(tiny_chat_model_folder), device=str(TEST_DEVICE), dtype="float32",
        kv_cache_memory_gib=TEST_KV_CACHE_GIB))
    yield engine
    engine.shutdown()


def _blocks_free(engine: AsyncEngine) -> bool:
    manager = engine.engine.block_manager
    return manager.num_free_blocks == manager.num_blocks


async def _wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_streamed_deltas_add_up_to_the_final_output(async_engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def collect(prompt):
        deltas, ids, whole_copies, last = [], [], 0, None
        async for out in async_engine.generate(prompt, params):
            deltas.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            whole_copies += bool(out.token_ids)
            last = out
        return deltas, ids, whole_copies, last

    async def main():
        return await asyncio.gather(*(collect(f"Hello number {i}") for i in range(6)))

    for deltas, ids, whole_copies, last in asyncio.run(main()):
        assert last.finished and last.finish_reason == "length"
        assert "".join(deltas) == last.text
        assert ids == last.token_ids and len(ids) == 12
        # the steps before carry their deltas: only the final output copies every token
        assert whole_copies == 1
    assert _blocks_free(async_engine)


def test_final_only_yields_the_first_and_the_whole_last_output(async_engine):
    """A response that is not streamed asks for two outputs: the first (its prompt is done) and
    the last, which carries everything the streamed outputs would have added up to."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

    async def collect(final_only):
        return [out async for out in async_engine.generate("Hello there", params,
                                                           final_only=final_only)]

    streamed, final_only = asyncio.run(collect(False)), asyncio.run(collect(True))
    assert len(streamed) > 2  # negative control: every step's output, without the option
    assert len(final_only) == 2 and not final_only[0].finished and final_only[1].finished
    first, last = final_only
    assert first.token_ids == streamed[0].token_ids
    assert (last.text, last.token_ids, last.finish_reason) == \
        (streamed[-1].text, streamed[-1].token_ids, streamed[-1].finish_reason)
    assert last.logprobs == streamed[-1].logprobs and len(last.logprobs) == 12
    assert _blocks_free(async_engine)


def test_leaving_the_stream_aborts_and_frees_blocks(async_engine):
    async def main():
        stream = async_engine.generate("Tell me a long story",
                                       SamplingParams(max_tokens=400, ignore_eos=True))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        await stream.aclose()
        await _wait_until(lambda: not async_engine.engine.has_unfinished())
        return count

    assert asyncio.run(main()) == 3
    assert _blocks_free(async_engine)


def test_abort_by_id_ends_the_stream(async_engine):
    async def main():
        outputs = []
        async for out in async_engine.generate("Count to a thousand",
                                               SamplingParams(max_tokens=400, ignore_eos=True),
                                               request_id="to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                async_engine.abort("to-abort")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs) < 400
    assert _blocks_free(async_engine)


def test_invalid_request_raises_in_the_caller(async_engine):
    async def main():
        async for _ in async_engine.generate("x", SamplingParams(max_tokens=10**6)):
            pass

    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(main())
    assert async_engine.is_running


def test_the_thread_that_steps_the_engine_also_built_it(tiny_chat_model_folder):
    """One thread does all model work, so the process has one OpenMP team (two halve the decode
    speed on a small machine: see engine.async_engine). The build runs on the step thread, not
    the caller's; every step runs there too."""
    config = EngineConfig.from_kwargs(model=str(tiny_chat_model_folder), device=str(TEST_DEVICE),
                                      dtype="float32", kv_cache_memory_gib=TEST_KV_CACHE_GIB)
    build_threads, step_threads = [], []

    def build():
        build_threads.append(threading.get_ident())
        return LLMEngine(config)

    engine = AsyncEngine(build)
    try:
        engine.before_step = lambda: step_threads.append(threading.get_ident())

        async def main():
            async for _ in engine.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True)):
                pass

        asyncio.run(main())
    finally:
        engine.shutdown()
    assert build_threads == [engine._thread.ident] != [threading.get_ident()]
    assert step_threads and set(step_threads) == set(build_threads)


def test_a_failed_build_raises_in_the_caller_and_leaves_no_loop():
    def build():
        raise ValueError("no such model")

    def step_threads() -> int:
        return sum(t.name == "specserve-engine" for t in threading.enumerate())

    before = step_threads()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
    assert step_threads() == before


def test_a_validated_request_is_generated_without_a_second_check(async_engine, monkeypatch):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    request = async_engine.validate("Hello there", params)
    calls = []
    make_request = async_engine.engine.make_request
    monkeypatch.setattr(async_engine.engine, "make_request",
                        lambda *args: calls.append(args) or make_request(*args))

    async def collect(prompt):
        return [out async for out in async_engine.generate(prompt, params, "validated-once")]

    outputs = asyncio.run(collect(request))
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 5
    assert outputs[-1].request_id == "validated-once" and calls == []
    asyncio.run(collect("Hello there"))  # negative control: a prompt is checked here
    assert len(calls) == 1
    with pytest.raises(ValueError, match="maximum context length"):
        async_engine.validate("Hello", SamplingParams(max_tokens=10**7))


def test_freed_memory_is_handed_back_once_a_burst_ends(async_engine, monkeypatch):
    """The loop trims the allocator when the engine goes idle after steps (engine/async_engine.py),
    never while a request still runs, and not again while it stays idle."""
    import engine.async_engine as module

    trims = []
    monkeypatch.setattr(module, "release_freed_host_memory",
                        lambda: trims.append(async_engine.engine.has_unfinished()))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def one(prompt):
        async for _ in async_engine.generate(prompt, params):
            pass

    async def burst() -> int:
        # What earlier tests left running ends first, and its own trim with it.
        await _wait_until(lambda: not async_engine.engine.has_unfinished())
        await asyncio.sleep(0.3)
        trims.clear()
        await asyncio.gather(one("one burst"), one("two requests"))
        await _wait_until(lambda: len(trims) >= 1)
        await asyncio.sleep(0.3)  # idle: no further trim
        return len(trims)

    for _ in range(2):
        # Once per idle moment: one, or two where the first request ended before the second
        # began; each with no request unfinished.
        assert asyncio.run(burst()) in (1, 2) and not any(trims), trims


def test_a_step_wakes_the_event_loop_once_whatever_its_number_of_streams(async_engine,
                                                                         monkeypatch):
    """engine/output_stream.py: a step's outputs reach the event loop in one
    `call_soon_threadsafe` at most, so a step that serves six streams wakes the loop once (or
    not at all, when the loop has not yet taken an earlier step's). The counts are the engine
    thread's calls; negative control: the steps served several streams each, so one call per
    output (the delivery this replaced) would have made more calls than steps."""
    num_streams, num_tokens = 6, 16
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    served_per_step = []
    step = async_engine.engine.step

    def counted_step():
        outputs = step()
        if outputs:
            served_per_step.append(len(outputs))
        return outputs

    async def main():
        await _wait_until(lambda: not async_engine.engine.has_unfinished())
        loop = asyncio.get_running_loop()
        wakeups = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if threading.current_thread() is async_engine._thread:
                wakeups.append(callback)
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        monkeypatch.setattr(async_engine.engine, "step", counted_step)

        async def one(i):
            return [out async for out in async_engine.generate(f"Stream {i}", params)]

        results = await asyncio.gather(*(one(i) for i in range(num_streams)))
        return wakeups, results

    wakeups, results = asyncio.run(main())
    assert all(sum(len(o.delta_token_ids) for o in outs) == num_tokens for outs in results)
    assert 1 <= len(wakeups) <= len(served_per_step)
    assert sum(served_per_step) >= num_streams * num_tokens > len(served_per_step)
    assert max(served_per_step) == num_streams
