"""The soak's mixed traffic (`--workload mixed`, issue 48): completions and chat, structured outputs
and tools, streamed and whole, and the check that each answer is what its request asked for. A
structured answer that is not valid JSON under its schema, or a required tool call that is
missing or whose arguments break the tool's parameters, is a wrong 200: the load generator
records it as a failure (`answer_violation`), never as a completion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 60},
                   "topics": {"type": "array", "maxItems": 3,
                              "items": {"type": "string", "maxLength": 20}}},
    "required": ["summary", "topics"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
_STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}}
_TOOLS_REQUIRED = {"tools": [WEATHER_TOOL], "tool_choice": "required"}
_TOOLS_AUTO = {"tools": [WEATHER_TOOL], "tool_choice": "auto"}


@dataclass(frozen=True)
class Flavour:
    name: str
    raw: bool  # a completion of a HumanEval prompt; else a chat turn on an MT-Bench question
    stream: bool
    extra: dict | None = None
    instruction: str = ""  # put before a chat prompt


FLAVOURS = (
    Flavour("completion-stream", raw=True, stream=True),
    Flavour("completion-whole", raw=True, stream=False),
    Flavour("chat-stream", raw=False, stream=True),
    Flavour("chat-whole", raw=False, stream=False),
    Flavour("json-stream", raw=False, stream=True, extra=_STRUCTURED,
            instruction="Summarize this question in JSON with its topics: "),
    Flavour("json-whole", raw=False, stream=False, extra=_STRUCTURED,
            instruction="Summarize this question in JSON with its topics: "),
    Flavour("tools-required", raw=False, stream=False, extra=_TOOLS_REQUIRED,
            instruction="Before answering, look up the weather in a city this question "
                        "suggests. "),
    Flavour("tools-auto-stream", raw=False, stream=True, extra=_TOOLS_AUTO,
            instruction="If the weather matters here, look it up: "),
)


def answer_violation(extra: dict | None, text: str, tool_calls: list[tuple[str, str]],
                     finish_reason: str | None) -> str | None:
    """What breaks the request in a finished answer (None: nothing). `tool_calls` holds (name,
    arguments) pairs. An answer cut at max_tokens (finish_reason "length") is only checked for
    what is complete: the tool calls it made, not its truncated JSON or a call it had no room
    to finish. Under tool_choice "auto" the
    output is parsed, not constrained (docs/structured-outputs.md), so only calls made under
    "required" are held to their tools' parameters."""
    extra = extra or {}
    if "response_format" in extra and finish_reason != "length":
        schema = extra["response_format"]["json_schema"]["schema"]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            return f"structured answer breaks its schema: {str(error)[:120]}"
    if extra.get("tool_choice") == "required" and not tool_calls and finish_reason != "length":
        return f"tool_choice required, and no tool call (finish_reason {finish_reason})"
    if extra.get("tool_choice") != "required":
        return None
    tools = {tool["function"]["name"]: tool["function"]["parameters"]
             for tool in extra.get("tools", [])}
    for name, arguments in tool_calls:
        if name not in tools:
            return f"call of an unknown tool {name!r}"
        try:
            jsonschema.validate(json.loads(arguments), tools[name])
        except (ValueError, jsonschema.ValidationError) as error:
            return f"arguments of {name} break its parameters: {str(error)[:120]}"
    return None
