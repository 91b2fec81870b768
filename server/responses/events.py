"""A response streamed as the Responses API's typed server-sent events.

Order: `response.created`, `response.in_progress`; per output item `response.output_item.added`,
for a message `response.content_part.added`, `response.output_text.delta`... and `.done`,
`response.content_part.done`; for a function call `response.function_call_arguments.delta`... and
`.done`; then `response.output_item.done`; last `response.completed` (or `response.incomplete`)
carrying the whole response. Every event has a `sequence_number`, from 0. A failure after the
stream started is an `error` event. Tool calls are found in the text exactly as chat streams them
(server.tools.ToolCallStream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable

from pydantic import BaseModel

from server.errors import SERVER_ERROR, APIError
from server.generation import FanOut
from server.responses.conversion import new_id
from server.responses.output import ResponseBuilder, status_of
from server.responses.protocol import (
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
)
from server.streaming import stream_error
from server.tools import ToolCallStream


class _Events:
    def __init__(self):
        self.sequence_number = 0

    def __call__(self, type: str, **fields) -> str:
        payload = {"type": type, "sequence_number": self.sequence_number,
                   **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                      for k, v in fields.items()}}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(payload)}\n\n"


class _Items:
    """The output items as the stream opens and closes them."""

    def __init__(self, emit: _Events):
        self.emit = emit
        self.done: list = []
        self.open = None  # the item being streamed: OutputMessage or OutputFunctionCall

    @property
    def index(self) -> int:
        return len(self.done)

    def text(self, delta: str) -> list[str]:
        out = []
        if not isinstance(self.open, OutputMessage):
            out += self.close()
            self.open = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
            out.append(self.emit("response.output_item.added", output_index=self.index,
                                 item=self.open))
            self.open.content.append(OutputText(text=""))
            out.append(self.emit("response.content_part.added", output_index=self.index,
                                 item_id=self.open.id, content_index=0,
                                 part=OutputText(text="")))
        if delta:
            self.open.content[0].text += delta
            out.append(self.emit("response.output_text.delta", output_index=self.index,
                                 item_id=self.open.id, content_index=0, delta=delta, logprobs=[]))
        return out

    def call(self, call: dict) -> list[str]:
        """One tool-call delta as chat streams it: a new call (with its id) or more arguments."""
        out = []
        arguments = call.get("function", {}).get("arguments", "")
        if "id" in call:
            out += self.close()
            self.open = OutputFunctionCall(id=new_id("fc"), call_id=call["id"],
                                           name=call["function"]["name"], arguments="",
                                           status="in_progress")
            out.append(self.emit("response.output_item.added", output_index=self.index,
                                 item=self.open))
        if arguments:
            self.open.arguments += arguments
            out.append(self.emit("response.function_call_arguments.delta",
                                 output_index=self.index, item_id=self.open.id, delta=arguments))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        out = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(self.emit("response.output_text.done", output_index=self.index,
                                 item_id=item.id, content_index=0, text=part.text, logprobs=[]))
            out.append(self.emit("response.content_part.done", output_index=self.index,
                                 item_id=item.id, content_index=0, part=part))
        else:
            out.append(self.emit("response.function_call_arguments.done", output_index=self.index,
                                 item_id=item.id, name=item.name, arguments=item.arguments))
        out.append(self.emit("response.output_item.done", output_index=self.index, item=item))
        self.done.append(item)
        return out


async def stream_events(builder: ResponseBuilder, fanout: FanOut,
                        save: Callable[[ResponseObject], Awaitable[None]]
                        ) -> AsyncGenerator[str, None]:
    """`save` runs on the finished response before `response.completed` is sent, so a client
    that has read it can fetch the stored response at once."""
    emit = _Events()
    items = _Items(emit)
    skeleton = builder.skeleton()
    try:
        yield emit("response.created", response=skeleton)
        yield emit("response.in_progress", response=skeleton)
        calls = ToolCallStream(builder.tools)
        final = None
        async for _, output in fanout:
            deltas = calls.feed(output.delta_text)
            if output.finished:
                deltas += calls.finish(output.text)
                final = output
            for delta in deltas:
                for event in (items.text(delta["content"]) if "content" in delta else
                              [e for call in delta["tool_calls"] for e in items.call(call)]):
                    yield event
        if final is None:
            raise APIError(500, "the engine ended the request without a final output",
                           SERVER_ERROR)
        status = status_of(final)[0]
        if not items.done and items.open is None:
            for event in items.text(""):  # no text and no call: an empty message, as whole
                yield event
        for event in items.close("incomplete" if status == "incomplete" else "completed"):
            yield event
        response = builder.finished(final, items.done)
        await save(response)
        yield emit(f"response.{status}", response=response)
    except Exception as error:
        api_error = stream_error(error)
        yield emit("error", code=api_error.code or api_error.type, message=api_error.message,
                   param=api_error.param)
    finally:
        await fanout.aclose()
