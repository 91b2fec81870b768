"""Tool calling: which tools a chat request offers, the constraint that enforces `required` and
named choices, the conversation as the chat template sees it, and tool calls read back out.

Formats. A named choice generates the function's arguments object alone (its JSON schema is the
grammar). `required` generates a JSON array of {"name", "arguments"} objects, one schema branch
per tool (one item at most without parallel_tool_calls). `auto` is free text in which calls are
written as Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
Qwen2 family's format), parsed from the output. Templates that render tools themselves get them;
for templates that do not, a system message describes the tools and the format (FALLBACK_PROMPT).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.grammar import Constraint
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, FunctionCallOut, ToolCallOut

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE),
                        re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
FALLBACK_PROMPT = (
    "You can call the following tools. To call a tool, reply with one "
    f"{TOOL_CALL_OPEN}{{\"name\": <tool name>, \"arguments\": <arguments object>}}"
    f"{TOOL_CALL_CLOSE} block per call and nothing else. Tools:\n")


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list  # [protocol.Tool]
    name: str | None = None  # the named function
    constraint: Constraint | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    @property
    def renders_tools(self) -> bool:
        return self.mode != "none"


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request offers no tools; 400s for inconsistent fields."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    # Each tool's parameter schema is checked off the event loop (server/structured.py).
    choice = body.tool_choice or "auto"
    if not isinstance(choice, str):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among "
                              f"the tools ({', '.join(names)})", "tool_choice")
        tool = body.tools[names.index(choice.function.name)]
        return ToolPlan("named", body.tools, tool.function.name,
                        Constraint.json_schema(_parameters(tool)))
    if choice == "required":
        return ToolPlan("required", body.tools, None, Constraint.json_schema(_calls_schema(
            body.tools, body.parallel_tool_calls)))
    return ToolPlan(choice, body.tools, parallel=body.parallel_tool_calls)


def _parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def _calls_schema(tools, parallel: bool) -> dict:
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": tool.function.name},
                                      "arguments": _parameters(tool)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for tool in tools]}
    schema = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ------------------------------------------------------------------ the conversation
def template_renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def conversation(body: ChatCompletionRequest, plan: ToolPlan | None,
                 native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template`. `native`: the template renders tools and
    tool calls itself; otherwise they are written into the text as FALLBACK_PROMPT says."""
    messages = []
    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message.text()}
        if message.tool_calls:
            if native:
                entry["tool_calls"] = [_native_call(call) for call in message.tool_calls]
            else:
                entry["content"] += "".join(_written_call(call) for call in message.tool_calls)
        if role == "tool":
            if native:
                entry["tool_call_id"] = message.tool_call_id
            else:
                entry = {"role": "user",
                         "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
        messages.append(entry)
    if plan is None or not plan.renders_tools:
        return messages, None
    tools = [tool.model_dump(exclude_none=True) for tool in plan.tools]
    if native:
        return messages, tools
    described = FALLBACK_PROMPT + "\n".join(json.dumps(t["function"]) for t in tools)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": described + "\n\n" + messages[0]["content"]}
    else:
        messages.insert(0, {"role": "system", "content": described})
    return messages, None


def _arguments(call) -> dict | str:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def _native_call(call) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": _arguments(call)}}


def _written_call(call) -> str:
    body = {"name": call.function.name, "arguments": _arguments(call)}
    return f"{TOOL_CALL_OPEN}{json.dumps(body)}{TOOL_CALL_CLOSE}"


# ------------------------------------------------------------------ the output
def new_call(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                       function=FunctionCallOut(name=name, arguments=arguments))


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCallOut]]:
    """(content, tool calls) of a finished output. Text that does not parse stays content."""
    if plan.mode == "named":
        return None, [new_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            return None, [new_call(c["name"], json.dumps(c["arguments"])) for c in calls]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # cut short by max_tokens
    if plan.mode == "auto":
        calls = []
        for block in _TOOL_CALL.findall(text):
            try:
                call = json.loads(block)
                calls.append(new_call(call["name"], json.dumps(call.get("arguments", {}))))
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []
        if calls:
            content = text[:text.index(TOOL_CALL_OPEN)].strip()
            # Unconstrained text may hold more calls than parallel_tool_calls=false allows.
            return content or None, calls if plan.parallel else calls[:1]
    return text, []


class ToolCallStream:
    """One streamed choice's text deltas as chat deltas: content, or OpenAI's tool-call deltas.

    Named calls stream their arguments as they come. `required` output is one JSON array, sent
    as whole calls once it is complete. `auto` streams content until a `<tool_call>` marker
    starts (holding back any text that may be the marker's beginning), then sends the calls
    when the choice finishes."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.called = False  # the choice produced tool calls
        self._pending = ""  # auto: text not yet sent, that may start a marker
        self._in_call = False

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.plan is None:
            return [{"content": text}]
        if self.plan.mode == "named":
            if self.called:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
            self.called = True
            call = new_call(self.plan.name, text)
            return [{"tool_calls": [{"index": 0, **call.model_dump()}]}]
        if self.plan.mode == "required" or self._in_call:
            return []
        self._pending += text
        if TOOL_CALL_OPEN in self._pending:
            self._in_call = True
            return _content(self._pending[:self._pending.index(TOOL_CALL_OPEN)])
        keep = next((n for n in range(len(TOOL_CALL_OPEN) - 1, 0, -1)
                     if self._pending.endswith(TOOL_CALL_OPEN[:n])), 0)
        ready, self._pending = self._pending[:len(self._pending) - keep], \
            self._pending[len(self._pending) - keep:]
        return _content(ready)

    def finish(self, text: str) -> list[dict]:
        """The deltas left once the choice has finished with the whole `text`."""
        if self.plan is None or self.plan.mode == "named":
            return []
        if self.plan.mode == "auto" and not self._in_call:
            return _content(self._pending)
        content, calls = parse_output(self.plan, text)
        if not calls:  # not a valid call after all: what was held back is content
            start = text.index(TOOL_CALL_OPEN) if self._in_call else 0
            return _content(text[start:])
        self.called = True
        return [{"tool_calls": [{"index": i, **call.model_dump()}]} for i, call in
                enumerate(calls)]


def _content(text: str) -> list[dict]:
    return [{"content": text}] if text else []
