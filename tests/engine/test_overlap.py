"""Overlapped decode steps (engine/runner/overlap.py, `--async-scheduling`): the same tokens, text, stops
and logprobs as synchronous steps, late stops never shown, aborts mid-flight clean, blocks free."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.runner.overlap import PLACEHOLDER
from tests.conftest import make_llm

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
           "The cat sat on the mat. The cat sat on the", "Hello", "1, 2, 3, 4, 5,"]


def _engines(folder, padded: bool):
    """(synchronous, overlapped) engines of the same model."""
    return [make_llm(str(folder), padded_steps=padded, enforce_eager=True,
                     speculative_method="none", async_scheduling=overlap)
            for overlap in (False, True)]


def _summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [(lp.token_id, round(lp.logprob, 5))
                                              for lp in o.logprobs]) for o in outputs]


def greedy_and_seeded_cases(greedy_tokens: int, step: int, sampled_tokens: int):
    """Greedy requests finishing at different steps (greedy_tokens + step * i tokens), then
    seeded sampling with the filters, and logprobs."""
    return [[SamplingParams(max_tokens=greedy_tokens + step * i, temperature=0, ignore_eos=True)
             for i in range(len(PROMPTS))],
            [SamplingParams(max_tokens=sampled_tokens, temperature=0.9, top_p=0.9, top_k=50,
                            seed=7 + i, ignore_eos=True, logprobs=2)
             for i in range(len(PROMPTS))]]


def _all_blocks_free(llm) -> bool:
    manager = llm.engine.block_manager
    return manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("padded", [False, True])
def test_overlapped_steps_give_the_synchronous_steps_outputs(tiny_chat_model_folder, padded):
    plain, overlapped = _engines(tiny_chat_model_folder, padded)
    assert plain.engine.overlap is None and overlapped.engine.overlap is not None
    for params in greedy_and_seeded_cases(6, 5, 12):
        expected = _summary(plain.generate(PROMPTS, params))
        before = overlapped.engine.overlap.num_overlapped
        assert _summary(overlapped.generate(PROMPTS, params)) == expected
        assert overlapped.engine.overlap.num_overlapped > before  # it did overlap
        assert _all_blocks_free(overlapped)


def test_a_stop_found_late_drops_the_token_scheduled_past_it(tiny_chat_model_folder):
    plain, overlapped = _engines(tiny_chat_model_folder, padded=False)
    free_run = plain.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0,
                                                      ignore_eos=True))
    stop_token = free_run[0].token_ids[6]
    stop_text = free_run[1].text[8:12]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop_text]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    expected = _summary(plain.generate(PROMPTS, params))
    assert expected[0][2] == "stop" and expected[1][2] == "stop"  # the stops do end them early
    assert len(expected[0][0]) < 20 and len(expected[1][0]) < 20
    assert _summary(overlapped.generate(PROMPTS, params)) == expected
    assert _all_blocks_free(overlapped)


def test_an_abort_in_flight_shows_no_placeholder_and_frees_its_blocks(tiny_chat_model_folder):
    plain, overlapped = _engines(tiny_chat_model_folder, padded=False)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    [reference] = plain.generate([PROMPTS[0]], params)
    engine = overlapped.engine
    request_id = engine.add_request(PROMPTS[0], params)
    streamed = []
    for _ in range(8):
        streamed += [t for o in engine.step() for t in o.delta_token_ids]
    assert engine.overlap.in_flight is not None  # a token is in flight as we abort
    aborted = engine.abort(request_id)
    assert aborted.finished and PLACEHOLDER not in aborted.token_ids
    assert aborted.token_ids == streamed == reference.token_ids[:len(streamed)]
    while engine.has_unfinished():  # the step in flight lands; its token is dropped
        assert engine.step() == []
    assert _all_blocks_free(overlapped)
    # and it keeps serving
    assert overlapped.generate([PROMPTS[0]], params)[0].token_ids == reference.token_ids


def test_a_request_arriving_mid_stream_lands_between_overlapped_steps(tiny_chat_model_folder):
    plain, overlapped = _engines(tiny_chat_model_folder, padded=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    engine = overlapped.engine
    first = engine.add_request(PROMPTS[0], params)
    tokens = {first: []}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
    second = engine.add_request(PROMPTS[1], params)
    tokens[second] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
    assert [tokens[first], tokens[second]] == alone
    assert _all_blocks_free(overlapped)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_nan_logits_in_an_overlapped_step_fail_that_request_alone(tiny_chat_model_folder, padded,
                                                                   temperature):
    """A NaN row found in a decode step that overlapped: its request ends with an error and
    none of the tokens past it, as a synchronous step would end it, and the other request
    runs on unchanged (its row was never zeroed, sampled or fed from the NaN one)."""
    from engine.faults import Faults

    plain, overlapped = _engines(tiny_chat_model_folder, padded)
    params = [SamplingParams(max_tokens=16, temperature=temperature, seed=3 + i, ignore_eos=True)
              for i in range(2)]
    reference = plain.generate(PROMPTS[:2], params)
    assert [o.finish_reason for o in reference] == ["length", "length"]  # the control
    engine = overlapped.engine
    ids = [engine.add_request(prompt, p) for prompt, p in zip(PROMPTS[:2], params)]
    streamed = {request_id: [] for request_id in ids}
    finished = {}

    def step():
        for out in engine.step():
            streamed[out.request_id] += out.delta_token_ids
            if out.finished:
                finished[out.request_id] = out

    for _ in range(6):
        step()
    assert engine.overlap.in_flight is not None
    faulty = next(r for r in engine.scheduler.running if r.request_id == ids[0])
    engine.faults = Faults(frozenset({"nan_logits"}))
    engine.faults._marked[faulty] = {"nan_logits"}  # its next launched step's rows are NaN
    while engine.has_unfinished():
        step()
    failed, other = finished[ids[0]], finished[ids[1]]
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert PLACEHOLDER not in failed.token_ids
    assert streamed[ids[0]] == reference[0].token_ids[:len(streamed[ids[0]])]
    assert len(streamed[ids[0]]) < 16
    assert other.finish_reason == "length" and streamed[ids[1]] == reference[1].token_ids
    assert _all_blocks_free(overlapped)
    engine.faults = Faults()
    assert overlapped.generate(PROMPTS[:1], params[:1])[0].token_ids == reference[0].token_ids
