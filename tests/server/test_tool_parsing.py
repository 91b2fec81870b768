"""Tool calls read back out of generated text (`auto`'s Hermes `<tool_call>` blocks, `required`'s
JSON array) whole and streamed, and the fallback prompt for templates without tools."""

from __future__ import annotations

import json

import pytest

from server.protocol import ChatCompletionRequest
from server.tools import FALLBACK_PROMPT, ToolCallStream, conversation, parse_output, plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TWO_CALLS = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
             '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _plan(tool_choice="auto", parallel=True):
    return plan_tools(ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
        tool_choice=tool_choice, parallel_tool_calls=parallel))


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_auto_reads_hermes_blocks_and_keeps_the_text_before_them():
    content, calls = parse_output(_plan(), TWO_CALLS)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    # Without parallel calls, the first call only.
    assert _calls(parse_output(_plan(parallel=False), TWO_CALLS)[1]) == [
        ("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("text", [
    "It is sunny in Oslo.",  # no call at all
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "get_weather"',  # never closed (cut by max_tokens)
])
def test_auto_text_that_is_not_a_call_stays_content(text):
    assert parse_output(_plan(), text) == (text, [])


def test_required_reads_the_array_and_a_cut_array_stays_content():
    plan = _plan("required")
    text = json.dumps([{"name": "get_time", "arguments": {}},
                       {"name": "get_weather", "arguments": {"city": "Rome"}}])
    assert _calls(parse_output(plan, text)[1]) == [("get_time", {}),
                                                   ("get_weather", {"city": "Rome"})]
    assert parse_output(plan, text[:20]) == (text[:20], [])
    # Without parallel calls the grammar allows one call only.
    assert _plan("required", parallel=False).constraint != plan.constraint


def _stream(plan, pieces: list[str]) -> list[dict]:
    stream = ToolCallStream(plan)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish("".join(pieces))


def test_auto_streams_content_then_whole_calls_with_the_marker_split_across_deltas():
    pieces = [TWO_CALLS[i:i + 3] for i in range(0, len(TWO_CALLS), 3)]  # "<to", "ol_", ...
    deltas = _stream(_plan(), pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me check. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"),
                                                                   (1, "get_time")]
    # Negative control: text that only looks like the start of a marker is sent as content.
    deltas = _stream(_plan(), ["a <to", "ol> b"])
    assert "".join(d.get("content", "") for d in deltas) == "a <tool> b"
    assert not any("tool_calls" in d for d in deltas)


def test_named_streams_arguments_as_they_come():
    plan = _plan({"type": "function", "function": {"name": "get_weather"}})
    deltas = _stream(plan, ['{"city"', ': "Oslo"}'])
    first, second = (d["tool_calls"][0] for d in deltas)
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    assert first["function"]["arguments"] + second["function"]["arguments"] == \
        '{"city": "Oslo"}'


def test_fallback_prompt_writes_tools_calls_and_results_into_the_text():
    body = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 degrees"}])
    messages, tools = conversation(body, plan_tools(body), native=False)
    assert tools is None and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith(FALLBACK_PROMPT) and "get_weather" in \
        messages[0]["content"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in \
        messages[2]["content"]
    assert messages[3] == {"role": "user",
                           "content": "<tool_response>\n3 degrees\n</tool_response>"}
    native, tools = conversation(body, plan_tools(body), native=True)
    assert tools[0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2] == {"role": "tool", "content": "3 degrees", "tool_call_id": "c1"}
