"""engine/core_process/wire.py: every message between the API process and the engine process comes
back equal to what was sent, the engine's own dataclasses rebuilt field by field; a message of the
wrong shape is refused, not half-read."""

from __future__ import annotations

import msgspec
import pytest

from engine.core_process import wire
from engine.grammar import Constraint
from engine.metrics.spec_stats import SpecStats
from engine.metrics.stats import RequestStats, StepStats
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


def _spec_stats() -> SpecStats:
    return SpecStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                     num_emitted_tokens=6, accepted_per_position=[2, 1, 1],
                     draft_tokens_by_method={"suffix": 6}, accepted_tokens_by_method={"suffix": 4})


def _output(finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="cmpl-1-0", prompt_token_ids=[1, 2, 3], text="Hello world",
        token_ids=[7, 8] if finished else [], delta_text=" world", delta_token_ids=[8],
        finished=finished, finish_reason="stop" if finished else None,
        stop_reason="\n" if finished else None,
        delta_logprobs=[TokenLogprob(8, -0.25, [(8, -0.25), (9, -1.5)])],
        num_cached_tokens=16, spec_stats=_spec_stats(), prompt="Say")


def _roundtrip_event(message):
    return wire.event_decoder().decode(wire.Encoder().encode(message))


def _roundtrip_command(message):
    return wire.command_decoder().decode(wire.Encoder().encode(message))


def test_a_step_message_comes_back_equal():
    step = StepStats(num_batched_tokens=40, step_seconds=0.012, num_running=2, num_waiting=1,
                     kv_cache_usage=0.25, num_prompt_tokens=32, num_generated_tokens=3,
                     num_preemptions=0, prefix_cache_queries=32, prefix_cache_hits=16,
                     spec=_spec_stats(), num_speculating=1, inter_token_latencies=[0.01, 0.02])
    finished = RequestStats(finish_reason="stop", num_prompt_tokens=3, num_generation_tokens=2,
                            queue_seconds=0.001, prefill_seconds=None, decode_seconds=0.5,
                            e2e_seconds=0.6, time_to_first_token=0.1, spec=_spec_stats())
    message = wire.StepMessage(
        outputs=[wire.without_prompt(_output()), wire.without_prompt(_output(finished=True))],
        errors=[wire.RequestError("cmpl-2-0", "the prompt is empty")],
        finished=[wire.RequestTimes("cmpl-1-0", "stop", 1.0, 1.5, 2.0, 2.1)],
        step_stats=[step], request_stats=[finished])
    decoded = _roundtrip_event(message)
    assert decoded == message
    assert isinstance(decoded.outputs[0], RequestOutput)
    assert isinstance(decoded.outputs[0].delta_logprobs[0], TokenLogprob)
    assert decoded.outputs[0].delta_logprobs[0].top == [(8, -0.25), (9, -1.5)]
    assert decoded.outputs[1].stop_reason == "\n" and decoded.outputs[1].token_ids == [7, 8]
    assert isinstance(decoded.step_stats[0].spec, SpecStats)
    assert decoded.step_stats[0].spec.draft_tokens_by_method == {"suffix": 6}
    assert decoded.request_stats[0].prefill_seconds is None


def test_outputs_travel_without_their_prompt():
    sent = wire.without_prompt(_output())
    assert sent.prompt_token_ids == [] and sent.prompt is None
    assert sent.delta_token_ids == [8] and sent.text == "Hello world"
    # Negative control: the prompt would otherwise travel with every step.
    assert len(wire.Encoder().encode(sent)) < len(wire.Encoder().encode(_output()))


def test_an_add_keeps_every_sampling_setting_and_the_front_stamps():
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.1, logit_bias={42: -100.0, 7: 2.5}, seed=3,
                            stop=("\n\n", "END"), stop_token_ids=(2,), logprobs=4,
                            skip_special_tokens=False,
                            structured=Constraint.json_schema({"type": "object"}))
    add = wire.AddRequest("r-1", [1, 2, 3], params, "text", "tenant", arrival_time=10.0,
                          rendered_time=10.001, tokenized_time=10.002, queued_time=10.003)
    decoded = _roundtrip_command(add)
    assert decoded == add
    assert decoded.params == params  # frozen dataclasses, tuples and int keys rebuilt
    assert decoded.params.logit_bias == {42: -100.0, 7: 2.5}
    assert isinstance(decoded.params.structured, Constraint)
    assert decoded.params.stop == ("\n\n", "END")
    # Negative control: a different setting is seen as different.
    other = wire.AddRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5), "text", "tenant")
    assert _roundtrip_command(other) != add


@pytest.mark.parametrize("command", [wire.Abort("r-9"), wire.AbortAll(), wire.Stop(),
                                     wire.SetBeforeStep(b"\x80\x04N.")])
def test_each_command_keeps_its_kind(command):
    assert _roundtrip_command(command) == command


def test_the_decoded_sampling_settings_are_checked_again():
    """A message cannot smuggle in what SamplingParams refuses: its checks run on decoding."""
    raw = msgspec.msgpack.encode({"type": "add", "request_id": "r", "prompt_token_ids": [1],
                                  "params": {"max_tokens": 0}})
    with pytest.raises(msgspec.ValidationError, match="max_tokens must be >= 1"):
        wire.command_decoder().decode(raw)


def test_a_message_of_the_wrong_shape_is_refused():
    encoder = wire.Encoder()
    with pytest.raises(msgspec.ValidationError):  # an unknown kind
        wire.command_decoder().decode(msgspec.msgpack.encode({"type": "launch"}))
    with pytest.raises(msgspec.ValidationError):  # token ids that are not integers
        wire.command_decoder().decode(msgspec.msgpack.encode(
            {"type": "add", "request_id": "r", "prompt_token_ids": ["a"], "params": {}}))
    with pytest.raises(msgspec.ValidationError):  # an event is not a command
        wire.command_decoder().decode(encoder.encode(wire.Dead("boom")))
