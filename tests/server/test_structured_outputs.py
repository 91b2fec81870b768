"""Structured outputs and tool calling through the real server and the official openai SDK:
`parse` with pydantic models, json_object, choice and regex, tools with every tool_choice (whole
and streamed), a tool result continuing the conversation, and every bad input as a 400."""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Species(str, enum.Enum):
    cat = "cat"
    dog = "dog"
    bird = "bird"


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: Species
    owner: Owner
    toys: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_parse_with_a_pydantic_model(client, server, temperature):
    completion = client.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet, temperature=temperature, seed=3, max_tokens=200)
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.species, Species)
    assert len(pet.toys) <= 3 and len(pet.name) <= 20 and 0 <= pet.owner.age <= 120


def test_json_object_streamed_equals_whole(client, server):
    # A prompt the model answers in a few keys with the integer kernels and with float weights
    # alike ("about the moon" loops inside a string with float weights, as on a GPU).
    request = dict(model=server.model, messages=[{"role": "user", "content": "A JSON object "
                   "describing the moon: its name and radius."}],
                   response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**request, stream=True) if chunk.choices)
    assert streamed == whole.message.content
    # Negative control: the same request without the format is not JSON.
    free = client.chat.completions.create(**{**request, "response_format": None})
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)


def test_choice_and_regex_on_completions(client, server):
    choice = client.completions.create(
        model=server.model, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0.8,
        seed=1, extra_body={"structured_outputs": {"choice": ["yes", "no", "it depends"]}})
    assert choice.choices[0].text in ("yes", "no", "it depends")
    regex = client.completions.create(
        model=server.model, prompt="A phone number:", max_tokens=30, temperature=0,
        extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"


def test_max_tokens_inside_a_grammar_finishes_with_length(client, server):
    completion = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A long JSON object."}],
        response_format={"type": "json_object"}, max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason == "length"


def _arguments_valid(call, tool) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_choice_required_and_named(client, server):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        completion = client.chat.completions.create(
            model=server.model, messages=ASK, tools=[TIME, WEATHER], tool_choice=tool_choice,
            parallel_tool_calls=False, temperature=0, max_tokens=60)
        [choice] = completion.choices
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        _arguments_valid(call, tool)
        if tool_choice != "required":
            assert call.function.name == "get_weather"


def test_tool_choice_none_and_auto_answer_in_text(client, server):
    for tool_choice in ("none", "auto"):
        completion = client.chat.completions.create(
            model=server.model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
            temperature=0, max_tokens=20)
        message = completion.choices[0].message
        if tool_choice == "none":
            assert message.tool_calls is None and message.content
        else:  # the small model may answer either way; what it says must be well formed
            assert message.content or message.tool_calls


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_tool_call_deltas_assemble(client, server, tool_choice):
    choice = tool_choice if tool_choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    request = dict(model=server.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
                   parallel_tool_calls=False, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice_delta in chunk.choices:
            reasons.append(choice_delta.finish_reason)
            for delta in choice_delta.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": whole.function.arguments}}
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_tool_result_continues_the_conversation(client, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    completion = client.chat.completions.create(model=server.model, messages=messages,
                                                tools=[WEATHER], temperature=0, max_tokens=30)
    assert completion.choices[0].message.content
    shorter = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER],
                                             temperature=0, max_tokens=1)
    # The call and its result are in the prompt.
    assert completion.usage.prompt_tokens > shorter.usage.prompt_tokens + 15


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a" * 200_000}, "guided_regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_structured_input_is_a_400(server, extra, param):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_the_server_keeps_serving_and_counts_structured_requests(client, server):
    before = server.metrics()
    client.chat.completions.create(model=server.model, messages=ASK, max_tokens=30,
                                   response_format={"type": "json_object"}, temperature=0)
    after = server.metrics()
    assert after["structured_requests_total"] > before.get("structured_requests_total", 0)
    assert after["grammar_compile_seconds_count"] > before.get("grammar_compile_seconds_count", 0)
    assert after["spec_decode_num_forced_draft_tokens_total"] > 0
