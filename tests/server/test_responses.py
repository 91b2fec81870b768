"""`/v1/responses` against the shared default-model server, through the openai SDK: create,
stream, parse with pydantic, a function call round trip over previous_response_id, stored
responses (retrieve, input items, delete), and every unsupported parameter refused by name."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response

from tests.server.conftest import assert_error

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_create_with_a_string_gives_a_message_and_usage(client, server):
    response = client.responses.create(model=server.model, input="Say hello.",
                                       instructions="Answer in one short sentence.",
                                       max_output_tokens=24, temperature=0,
                                       metadata={"case": "create"})
    assert isinstance(response, Response) and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 10 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert response.metadata == {"case": "create"}
    assert response.instructions == "Answer in one short sentence."


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    response = client.responses.create(model=server.model, input="Count from one to fifty.",
                                       max_output_tokens=16, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16


def test_stream_has_typed_events_in_order_and_equals_the_whole_response(client, server):
    """Same seed, same output; the control: sequence numbers count from 0 without a gap."""
    kwargs = dict(model=server.model, input=[{"role": "user", "content": "Name three colors."}],
                  max_output_tokens=20, temperature=0.7, extra_body={"seed": 5})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    # The last event carries the whole response, completed or (20 tokens reached) incomplete;
    # the SDK's get_final_response() accepts only a completed one.
    final = events[-1].response
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_parse_with_a_pydantic_model(client, server):
    response = client.responses.parse(model=server.model, input="Describe a city as JSON.",
                                      text_format=City, max_output_tokens=60, temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


def test_an_unlisted_property_is_never_generated(client, server):
    """A schema without additionalProperties gets only its listed keys (as xgrammar's)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"]}
    response = client.responses.create(
        model=server.model, input="Describe a person as JSON with many fields.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=40, temperature=1.0, extra_body={"seed": 1})
    assert set(json.loads(response.output_text)) == {"name"}


def test_function_call_round_trip_over_previous_response_id(client, server):
    first = client.responses.create(model=server.model, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and json.loads(call.arguments)["city"]
    second = client.responses.create(
        model=server.model, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 21})}],
        max_output_tokens=30, temperature=0)
    assert second.previous_response_id == first.id
    assert second.output[0].type == "message" and second.output_text
    # The conversation was rebuilt from the store, so its prompt starts as the first one did.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # The control: without previous_response_id the tool output has no call to answer.
    alone = client.responses.create(
        model=server.model, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21"}],
        max_output_tokens=1, temperature=0)
    assert alone.usage.input_tokens < second.usage.input_tokens


def test_streamed_function_call_arguments(client, server):
    with client.responses.stream(model=server.model, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    assert json.loads(call.arguments)["city"]


def test_stored_response_retrieve_input_items_and_delete(client, server):
    created = client.responses.create(model=server.model, input="Hi!", max_output_tokens=4,
                                      temperature=0)
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    items = client.responses.input_items.list(created.id)
    [item] = items.data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi!"
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model=server.model, input="Hi!", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("field, value, param", [
    ("reasoning", {"effort": "low"}, "reasoning"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("truncation", "auto", "truncation"),
    ("background", True, "background"),
    ("prompt_cache_key", "k", "prompt_cache_key"),
    ("tools", [{"type": "web_search"}], "tools.0.type"),
    ("tools", [{"type": "file_search", "vector_store_ids": ["v"]}], "tools.0.type"),
    ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
    ("previous_response_id", "resp_missing", "previous_response_id"),
])
def test_unsupported_parameters_are_refused_by_name(server, field, value, param):
    """The control: the same request without the field is served."""
    body = {"model": server.model, "input": "Hi", "max_output_tokens": 1}
    url = f"{server.base_url}/v1/responses"
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    status = 404 if field == "previous_response_id" else 400
    assert_error(httpx.post(url, json={**body, field: value}, timeout=60), status, param)


def test_null_and_default_values_of_unserved_fields_pass(server):
    body = {"model": server.model, "input": "Hi", "max_output_tokens": 1, "reasoning": None,
            "include": [], "truncation": "disabled", "background": False}
    assert httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60).status_code == 200


def test_input_image_is_refused(server):
    body = {"model": server.model, "max_output_tokens": 1, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert_error(response, 400)
    assert "input" in response.json()["error"]["param"]


def test_input_items_page_in_either_order(client, server):
    words = ["one", "two", "three"]
    created = client.responses.create(
        model=server.model, max_output_tokens=1,
        input=[{"role": "user", "content": word} for word in words])
    texts = lambda page: [item.content[0].text for item in page.data]  # noqa: E731
    assert texts(client.responses.input_items.list(created.id)) == words[::-1]  # desc: default
    first = client.responses.input_items.list(created.id, order="asc", limit=2)
    assert texts(first) == words[:2] and first.has_more
    rest = client.responses.input_items.list(created.id, order="asc", after=first.last_id)
    assert texts(rest) == words[2:] and not rest.has_more


def test_the_wire_shapes_validate_strictly_as_the_sdks_types(server):
    """The SDK builds its objects leniently; here every object and event must validate as its
    own type, whole and streamed, a function call among them."""
    from openai.types.responses import ResponseItem, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": server.model, "input": "Weather in Oslo?", "tools": [WEATHER],
            "tool_choice": "required", "max_output_tokens": 30, "temperature": 0}
    url = f"{server.base_url}/v1/responses"
    whole = Response.model_validate(httpx.post(url, json=body, timeout=120).json(), strict=False)
    assert whole.output[0].type == "function_call"
    items = httpx.get(f"{url}/{whole.id}/input_items", timeout=30).json()["data"]
    assert [type(TypeAdapter(ResponseItem).validate_python(i)).__name__ for i in items] == \
        ["ResponseInputMessageItem"]
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as stream:
        lines = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    parsed = [events.validate_json(line) for line in lines]
    assert parsed[-1].type == "response.completed"
    assert parsed[-1].response.output[0].type == "function_call"
