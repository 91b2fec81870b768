"""engine/core_process/client.py: the engine in its own process behind AsyncEngine's face. The same
outputs as the in-thread engine; its checks, its request failures and its death as the in-thread
engine has them; an abort frees the engine's blocks."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.async_engine import EngineDeadError, RequestFailedError
from engine.core_process import EngineCoreClient
from engine.faults import FAULT_ENV, marker
from engine.grammar import Constraint
from tests.conftest import TEST_DEVICE, TEST_KV_CACHE_GIB
from tests.servers import wait_until

PROMPTS = ["Hello there", "The sky is", "One two three", "Paris is the capital of"]


def _config(model_folder) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_folder), device=str(TEST_DEVICE),
                                    dtype="float32", kv_cache_memory_gib=TEST_KV_CACHE_GIB)


@pytest.fixture(scope="module")
def engines(tiny_chat_model_folder):
    thread, process = None, None
    try:
        thread = AsyncEngine.from_config(_config(tiny_chat_model_folder))
        process = EngineCoreClient(_config(tiny_chat_model_folder))
        yield thread, process
    finally:
        for engine in (thread, process):
            if engine is not None:
                engine.shutdown()


async def _run(engine, prompt: str, params: SamplingParams, final_only: bool = False):
    """(text, token ids, finish reason, number of outputs)."""
    request = engine.validate(engine.tokenizer(prompt)["input_ids"], params)
    text, token_ids, count = "", [], 0
    async for output in engine.generate(request, final_only=final_only):
        text += output.delta_text
        token_ids += output.delta_token_ids
        count += 1
    if not final_only:  # the deltas add up to the whole; with final_only the last is whole
        assert output.text == text and output.token_ids == token_ids
    return output.text, output.token_ids, output.finish_reason, count


def test_greedy_outputs_equal_the_in_thread_engine(engines):
    thread, process = engines
    params = SamplingParams(max_tokens=12, temperature=0)

    async def both(final_only):
        return [(await _run(thread, p, params, final_only))[:3] for p in PROMPTS], \
            [(await _run(process, p, params, final_only))[:3] for p in PROMPTS]

    for final_only in (False, True):
        expected, got = asyncio.run(both(final_only))
        assert got == expected
    # Negative control: another max_tokens gives other tokens, and the comparison sees it.
    shorter = asyncio.run(_run(process, PROMPTS[0], SamplingParams(max_tokens=5, temperature=0)))
    assert shorter[1] != expected[0][1]


def test_final_only_yields_the_first_and_the_last_output(engines):
    _, process = engines
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert asyncio.run(_run(process, PROMPTS[1], params, final_only=True))[3] <= 2
    assert asyncio.run(_run(process, PROMPTS[1], params))[3] > 2  # negative control


def test_a_structured_request_reaches_the_engine_intact(engines):
    thread, process = engines
    params = SamplingParams(max_tokens=12, temperature=0,
                            structured=Constraint("regex", "(yes|no), [0-9]{3}"))

    async def both():
        return await _run(thread, PROMPTS[0], params), await _run(process, PROMPTS[0], params)

    expected, got = asyncio.run(both())
    assert re.fullmatch("(yes|no), [0-9]{3}", got[0])
    assert got[:3] == expected[:3]


def test_the_front_refuses_what_the_engine_would(engines):
    thread, process = engines
    too_long = SamplingParams(max_tokens=thread.limits.max_model_len)
    for engine in engines:
        with pytest.raises(ValueError) as refused:
            engine.validate([1, 2, 3], too_long)
        assert "maximum context length" in str(refused.value)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        process.validate([process.vocab_size], SamplingParams())
    with pytest.raises(ValueError):
        process.validate([1], SamplingParams(structured=Constraint("regex", "(unclosed")))
    assert process.limits == thread.limits and process.model_name == thread.model_name


def test_leaving_a_stream_early_frees_the_engines_blocks(engines):
    _, process = engines

    async def leave_after_two():
        request = process.validate(process.tokenizer(PROMPTS[3])["input_ids"],
                                   SamplingParams(max_tokens=400, ignore_eos=True))
        count = 0
        async for _ in process.generate(request):
            count += 1
            if count == 2:
                running, _, usage = process.load()
                assert usage > 0 and not process.is_idle()  # negative control: held now
                break

    asyncio.run(leave_after_two())
    wait_until(process.is_idle, 10, "the aborted request's blocks to be freed")
    free, total = process.kv_blocks()
    assert free == total > 0


def test_a_request_that_fails_alone_fails_alone(tiny_chat_model_folder, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "row_error")
    process = EngineCoreClient(_config(tiny_chat_model_folder))
    try:
        params = SamplingParams(max_tokens=6, temperature=0)
        with pytest.raises(RequestFailedError):
            asyncio.run(_run(process, f"hi {marker('row_error')}", params))
        assert asyncio.run(_run(process, PROMPTS[0], params))[2] in ("length", "stop")
        assert process.is_running
    finally:
        process.shutdown()


def test_a_failed_step_or_a_killed_process_ends_every_request(tiny_chat_model_folder,
                                                              monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "step_error")
    for kill in (False, True):
        process = EngineCoreClient(_config(tiny_chat_model_folder))
        deaths = []
        process.on_dead = deaths.append
        try:
            async def in_flight(kill: bool):
                params = SamplingParams(max_tokens=400, ignore_eos=True)
                prompt = PROMPTS[0] if kill else f"hi {marker('step_error')}"
                request = process.validate(process.tokenizer(prompt)["input_ids"], params)
                async for _ in process.generate(request):
                    if kill:
                        os.kill(process.engine_pid, signal.SIGKILL)
                        kill = False  # once

            started = time.monotonic()
            with pytest.raises(EngineDeadError):
                asyncio.run(asyncio.wait_for(in_flight(kill), 15))  # never a hang
            assert time.monotonic() - started < 10
            wait_until(lambda: deaths, 5, "on_dead")
            assert not process.is_running
            with pytest.raises(EngineDeadError):
                asyncio.run(_run(process, PROMPTS[0], SamplingParams(max_tokens=2)))
        finally:
            process.shutdown()
