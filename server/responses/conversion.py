"""A Responses request as the chat request the engine path already serves.

The Responses API is chat with another wire format: `instructions` is a system message, input
items are messages, `function_call` items are an assistant's tool calls and `function_call_output`
items are tool messages; `text.format` is `response_format`. Turning one into the other here lets
`server.chat.prepare_chat` do the rest (template, tools, constraint, speculation) for both.
"""

from __future__ import annotations

import uuid

from pydantic import ValidationError

from server.errors import bad_request, from_validation_errors
from server.protocol import ChatCompletionRequest
from server.responses.protocol import (
    ACCEPTED_DEFAULTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    ResponsesRequest,
)

UNSUPPORTED_REASONS = {
    "reasoning": "reasoning is not supported: the served model has no reasoning mode",
    "include": "include is not supported: no output this server makes has extra parts",
    "truncation": "truncation 'auto' is not supported: a conversation longer than the context "
                  "is refused",
    "background": "background responses are not supported",
    "conversation": "conversation objects are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_supported(body: ResponsesRequest) -> None:
    """A 400 naming the first field this server does not serve (null or a field's documented
    default is no request for anything, and passes)."""
    for name, value in (body.model_extra or {}).items():
        if value is None or (name in ACCEPTED_DEFAULTS and value == ACCEPTED_DEFAULTS[name]):
            continue
        raise bad_request(UNSUPPORTED_REASONS.get(name, f"{name} is not supported by this server"),
                          name)


def input_items(body: ResponsesRequest) -> list:
    """The request's own input as typed items with ids (as stored and listed)."""
    if isinstance(body.input, str):
        items = [MessageItem(role="user", content=[InputText(type="input_text", text=body.input)])]
    else:
        items = list(body.input)
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    out = []
    for item in items:
        # Listed as OpenAI lists them: an id and a status on each item, a message's content
        # always as parts.
        update = {"status": item.status or "completed"}
        if not item.id:
            update["id"] = new_id(prefixes[item.type])
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                update["content"] = [InputText(type=kind, text=item.content,
                                               annotations=[] if kind == "output_text" else None)]
        out.append(item.model_copy(update=update))
    return out


def chat_request(body: ResponsesRequest, history: list, items: list) -> ChatCompletionRequest:
    """`history`: the items of the responses before (previous_response_id), oldest first: their
    inputs and outputs; `items`: this request's input."""
    messages = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    for item in [*history, *items]:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
    if not messages:
        raise bad_request("input is empty: give a string or at least one item", "input")
    fields = {"model": body.model, "messages": messages, "stream": bool(body.stream),
              "max_completion_tokens": body.max_output_tokens, "seed": body.seed,
              "user": body.user, "response_format": _response_format(body)}
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in function_tools(body)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        raise from_validation_errors(error.errors()) from None


def function_tools(body: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for index, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools.{index}: the built-in tool {kind!r} is not supported; "
                              "only function tools are", f"tools.{index}.type")
        try:
            tools.append(FunctionTool.model_validate(tool))
        except ValidationError as error:
            raise _nested(error, f"tools.{index}") from None
    return tools


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or \
            set(choice) - {"type", "name"}:
        raise bad_request("tool_choice must be none, auto, required or "
                          '{"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a name and a schema",
                          "text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
            "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _nested(error: ValidationError, prefix: str):
    errors = [{**e, "loc": (*prefix.split("."), *e.get("loc", ()))} for e in error.errors()]
    return from_validation_errors(errors)
