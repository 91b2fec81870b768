"""engine/output_stream.py: outputs merged for a reader that falls behind, exactly; and a reader
that stops reading stalls neither the engine nor the other streams."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from engine.output_stream import merge_outputs
from engine.outputs import RequestOutput, TokenLogprob
from tests.conftest import TEST_DEVICE, TEST_KV_CACHE_GIB


@pytest.fixture(scope="module")
def async_engine(tiny_chat_model_folder):
    engine = AsyncEngine.from_config(EngineConfig.from_kwargs(
        model=str(tiny_chat_model_folder), device=str(TEST_DEVICE), dtype="float32",
        kv_cache_memory_gib=TEST_KV_CACHE_GIB))
    yield engine
    engine.shutdown()


def _output(delta_ids, text, delta_text, finished=False, with_logprobs=True) -> RequestOutput:
    logprobs = [TokenLogprob(t, -0.5 * t, [(t, -0.5 * t)]) for t in delta_ids]
    return RequestOutput(
        request_id="r", prompt_token_ids=[1], text=text, token_ids=[], delta_text=delta_text,
        delta_token_ids=list(delta_ids), finished=finished,
        finish_reason="length" if finished else None,
        delta_logprobs=logprobs if with_logprobs and delta_ids else None)


def test_merged_outputs_carry_every_delta_and_the_last_outputs_state():
    outputs = [_output([5], "a", "a"), _output([], "a", "", with_logprobs=False),
               _output([6, 7], "ab", "b"), _output([8], "abc", "c", finished=True)]
    merged = merge_outputs(outputs)
    assert merged.delta_text == "abc" == merged.text
    assert merged.delta_token_ids == [5, 6, 7, 8]
    assert [lp.token_id for lp in merged.delta_logprobs] == [5, 6, 7, 8]
    assert merged.finished and merged.finish_reason == "length"
    assert merge_outputs(outputs[:1]) is outputs[0]
    assert merge_outputs([outputs[1]]).delta_logprobs is None
    with pytest.raises(ValueError, match="no outputs"):
        merge_outputs([])


def _concatenated(outputs):
    return ("".join(o.delta_text for o in outputs),
            [t for o in outputs for t in o.delta_token_ids],
            [(lp.token_id, lp.logprob, lp.top) for o in outputs for lp in o.delta_logprobs or []])


def test_a_reader_that_falls_behind_gets_one_merged_output_equal_to_the_steps_it_missed(
        async_engine):
    """The reader takes the first output, then blocks its event loop while the engine steps on;
    what piled up comes as one output. Its text, token ids and logprobs equal a prompt reader's
    (greedy); negative control: the prompt reader got an output a step."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    async def read(away_s: float):
        loop = asyncio.get_running_loop()
        wakeups = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if threading.current_thread() is async_engine._thread:
                wakeups.append(callback)
            return call_soon_threadsafe(callback, *args, **kwargs)

        stream = async_engine.generate("Merge these outputs", params)
        outputs = [await stream.__anext__()]
        loop.call_soon_threadsafe = counted
        time.sleep(away_s)  # the loop is blocked: what the engine posts waits for it
        outputs += [out async for out in stream]
        return outputs, len(wakeups)

    prompt, prompt_wakeups = asyncio.run(read(0.0))
    behind, behind_wakeups = asyncio.run(read(1.0))
    assert len(prompt) > 3 and len(behind) == 2
    # the loop was woken once for all the steps it missed (at most one wake-up pending)
    assert behind_wakeups == 1 < prompt_wakeups
    assert _concatenated(behind) == _concatenated(prompt)
    assert len(_concatenated(prompt)[1]) == 24
    assert (behind[-1].text, behind[-1].token_ids, behind[-1].finish_reason) == \
        (prompt[-1].text, prompt[-1].token_ids, prompt[-1].finish_reason)
    assert behind[-1].logprobs == prompt[-1].logprobs


def test_a_stalled_reader_stalls_neither_the_engine_nor_other_streams(async_engine):
    """Stream A stops reading after its first output and waits for stream B to finish: B
    finishes, the engine keeps stepping (A's unread outputs pile up), and A then gets all it
    missed, merged, equal to what it would have read."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    async def main():
        b_done = asyncio.Event()
        piled_up = []

        async def stalled():
            stream = async_engine.generate("Stalled reader", params, request_id="stalled")
            outputs = [await stream.__anext__()]
            await asyncio.wait_for(b_done.wait(), timeout=60)
            piled_up.append(len(async_engine._streams["stalled"].pending))
            outputs += [out async for out in stream]
            return outputs

        async def other():
            outputs = [out async for out in async_engine.generate("Other reader", params)]
            b_done.set()
            return outputs

        return await asyncio.gather(stalled(), other()), piled_up

    (a, b), piled_up = asyncio.run(main())
    assert b[-1].finished and len(b[-1].token_ids) == 32
    assert piled_up[0] > 1  # the engine stepped on while A read nothing
    assert a[-1].finished and len(a) <= 3

    async def alone():
        return [out async for out in async_engine.generate("Stalled reader", params)]

    assert _concatenated(a)[:2] == _concatenated(asyncio.run(alone()))[:2]


def test_a_stream_interval_posts_every_nth_step_and_loses_nothing(tiny_chat_model_folder,
                                                                   async_engine):
    """`stream_interval` 4: the first output at once, then the tokens of four steps at a time
    (the last with them), equal in text, ids and logprobs to every step's; negative control:
    the engine with the default interval gave an output a step."""
    config = EngineConfig.from_kwargs(
        model=str(tiny_chat_model_folder), device=str(TEST_DEVICE), dtype="float32",
        kv_cache_memory_gib=TEST_KV_CACHE_GIB)
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(lambda: LLMEngine(config), stream_interval=0)
    spaced = AsyncEngine(lambda: LLMEngine(config), stream_interval=4)
    params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True, logprobs=1)

    async def collect(engine):
        return [out async for out in engine.generate("Space these outputs", params)]

    try:
        every, four = asyncio.run(collect(async_engine)), asyncio.run(collect(spaced))
    finally:
        spaced.shutdown()
    assert len(four) <= 5 < len(every)
    assert len(four[0].delta_token_ids) == 1  # the first token is not held back
    assert _concatenated(four) == _concatenated(every)
    assert four[-1].finished and four[-1].token_ids == every[-1].token_ids
