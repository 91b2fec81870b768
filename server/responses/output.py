"""One response object: what the engine's final output becomes (output items, status, usage), and
the request's settings echoed back as OpenAI echoes them."""

from __future__ import annotations

import time

from engine.outputs import RequestOutput
from server.chat import ChatPlan
from server.context import ServerContext
from server.generation import build_usage
from server.responses.conversion import new_id
from server.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.tools import parse_output


def status_of(final: RequestOutput) -> tuple[str, IncompleteDetails | None]:
    if final.finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if final.finish_reason == "abort":  # a drain's deadline ended it
        return "incomplete", IncompleteDetails()
    return "completed", None


def usage_of(plan: ChatPlan, final: RequestOutput) -> ResponseUsage:
    usage = build_usage([plan.prompt], [final])
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        speculative=usage.speculative.model_dump())


class ResponseBuilder:
    """The response of one request, from its skeleton (status in_progress) to its end."""

    def __init__(self, context: ServerContext, body: ResponsesRequest, plan: ChatPlan,
                 tools: list):
        self.id = new_id("resp")
        self.created_at = time.time()
        self.context = context
        self.body = body
        self.plan = plan
        self.tools = plan.tools if plan.tools is not None and plan.tools.mode != "none" else None
        self.tool_specs = [tool.model_dump(exclude_none=True) for tool in tools]

    def skeleton(self) -> ResponseObject:
        body = self.body
        text = {"format": {"type": "text"}}
        if body.text is not None and body.text.format is not None:
            text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        return ResponseObject(
            id=self.id, created_at=self.created_at, status="in_progress",
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {}, model=self.context.model_name,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id, store=body.store is not False,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, text=text,
            tool_choice=body.tool_choice or "auto", tools=self.tool_specs, user=body.user)

    def finished(self, final: RequestOutput, output: list) -> ResponseObject:
        status, details = status_of(final)
        return self.skeleton().model_copy(update={
            "status": status, "incomplete_details": details, "output": output,
            "completed_at": time.time(), "usage": usage_of(self.plan, final)})

    def output_items(self, final: RequestOutput) -> list:
        """The whole output: a message with the text (where there is text, or no call), then one
        function_call item per call."""
        content, calls = final.text, []
        if self.tools is not None:
            content, calls = parse_output(self.tools, final.text)
        status = "incomplete" if status_of(final)[0] == "incomplete" else "completed"
        items = []
        if content or not calls:
            items.append(OutputMessage(id=new_id("msg"), status=status,
                                       content=[OutputText(text=content or "")]))
        items.extend(OutputFunctionCall(id=new_id("fc"), call_id=call.id,
                                        name=call.function.name,
                                        arguments=call.function.arguments) for call in calls)
        return items

    def complete(self, final: RequestOutput) -> ResponseObject:
        return self.finished(final, self.output_items(final))
