"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, a reply out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import APIRouter, BackgroundTasks, Depends, Request

from server.context import ServerContext, get_context, require_api_key
from server.errors import APIError, bad_request, parse_body
from server.generation import (
    Choice,
    FanOut,
    Prompt,
    build_usage,
    check_stream_options,
    finish_reason,
    plan_choices,
    requested_max_tokens,
    respond,
    sampling_params,
)
from server.logprobs import TokenTexts, chat_logprobs
from server.prompt_tokens import tokenize_text
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from server.sse_chunks import TextChunks
from server.streaming import DONE, error_event, event
from server.structured import prepare_constraint
from server.templates import TemplateLimitError
from server.tenants import cache_partition
from server.timeline import FrontClock, WriteClock
from server.tools import (
    ToolCallStream,
    ToolPlan,
    conversation,
    parse_output,
    plan_tools,
    template_renders_tools,
)

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, background: BackgroundTasks,
                                 context: ServerContext = Depends(get_context)):
    clock = FrontClock.since_arrival(request.scope)
    body = await parse_body(request, ChatCompletionRequest)
    check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    plan = await prepare_chat(context, body, cache_partition(request, body.cache_salt), clock)
    response = _Response(context, body, plan.prompt, plan.choices, plan.tools)
    clock.hand_over(plan.choices)
    if not body.stream:  # background tasks run once the response's body has been sent
        background.add_task(response.writes.written_whole_and_observe)
    return await respond(request, context, response, plan.choices, body.stream)


@dataclass(frozen=True)
class ChatPlan:
    """A chat request made ready for the engine: its prompt, its validated choices and tools."""

    prompt: Prompt
    choices: list[Choice]
    tools: ToolPlan | None


async def prepare_chat(context: ServerContext, body: ChatCompletionRequest,
                       partition: str, clock: FrontClock | None = None) -> ChatPlan:
    """Everything between a parsed chat request and the engine: tools, the structured-output
    constraint, the chat template, sampling parameters and the engine's own checks. The
    Responses API (server/responses/) comes through here too, so both run the same path.
    `partition`: the tenant's share of the prefix and suffix caches (server/tenants.py).
    `clock` takes the front's stamps (server/timeline.py)."""
    context.check_model(body.model)
    context.admission.check_size(body.n, f"n={body.n}")
    tools = plan_tools(body)
    structured = await prepare_constraint(context, body, tools)
    prompt = await render_prompt(context, body, tools, clock)
    requested = requested_max_tokens(body)  # None: the default for this endpoint
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(context, body, prompt, requested, num_logprobs, structured)
    choices = plan_choices(context, [prompt], [params], body.n, partition)
    return ChatPlan(prompt, choices, tools)


async def render_prompt(context: ServerContext, body: ChatCompletionRequest,
                        tools: ToolPlan | None, clock: FrontClock | None = None) -> Prompt:
    """The messages through the model's chat template (in a renderer process, under its limits),
    then the tokenizer (on a thread for a long prompt: server/prompt_tokens.py)."""
    tokenizer = context.engine.tokenizer
    if context.templates is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    messages, tool_specs = conversation(body, tools, template_renders_tools(tokenizer))
    try:
        text = await context.templates.render(tokenizer.get_chat_template(None, tool_specs),
                                              messages, tool_specs, body.add_generation_prompt)
    except TemplateLimitError as error:
        # The template is the server's, but these messages made it overrun: the request is
        # what cannot be served.
        raise APIError(400, f"the model's chat template {error}; it was stopped", param="messages",
                       code="chat_template_limit") from None
    if clock is not None:
        clock.mark_rendered()
    # The template writes any special tokens itself (a BOS among them): add none twice.
    ids = await tokenize_text(tokenizer, text, add_special_tokens=False)
    if clock is not None:
        clock.mark_tokenized()
    return Prompt(ids, text)


def is_content_only(delta: dict) -> bool:
    """A delta of text alone: the chunk `TextChunks` renders without pydantic."""
    return len(delta) == 1 and type(delta.get("content")) is str


def tool_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class _Response:
    """Builds one chat completion, whole or as a stream of chunks."""

    def __init__(self, context: ServerContext, body: ChatCompletionRequest, prompt: Prompt,
                 choices: list[Choice], tools: ToolPlan | None):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.created = int(time.time())
        self.context = context
        self.body = body
        self.prompt = prompt
        self.choices = choices
        self.texts = TokenTexts(context.engine.tokenizer)
        self.num_top = body.top_logprobs or 0
        self.writes = WriteClock(context, choices)

    def _logprobs(self, logprobs):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.texts, logprobs or [], self.num_top)

    def _message(self, final) -> tuple[AssistantMessage, str | None]:
        """The reply and its finish reason: "tool_calls" where the text held calls."""
        reason = finish_reason(final)
        if self.tools is None:
            return AssistantMessage(content=final.text), reason
        content, calls = parse_output(self.tools, final.text)
        return (AssistantMessage(content=content, tool_calls=calls or None),
                tool_reason(reason, bool(calls)))

    def complete(self, finals: dict) -> ChatCompletionResponse:
        out = []
        for c in self.choices:
            message, reason = self._message(finals[c.index])
            out.append(ChatChoice(index=c.index, message=message, finish_reason=reason,
                                  logprobs=self._logprobs(finals[c.index].logprobs)))
        usage = build_usage([self.prompt], [finals[c.index] for c in self.choices])
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.context.model_name, choices=out, usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created,
                                   model=self.context.model_name, choices=choices, usage=usage)

    def _content_chunk(self, index: int, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta={"content": text})])

    async def events(self, fanout: FanOut) -> AsyncGenerator[str, None]:
        with_usage = self.body.include_usage
        content_events = TextChunks(self._content_chunk, with_usage)
        finals = {}
        streams = {c.index: ToolCallStream(self.tools) for c in self.choices}
        try:
            for choice in self.choices:  # the role first, before any token is ready
                yield event(self._chunk([ChatChunkChoice(
                    index=choice.index, delta={"role": "assistant", "content": ""})]), with_usage)
            async for index, output in fanout:
                self.writes.tokens_ready(index, output)
                logprobs = self._logprobs(output.delta_logprobs)
                stream = streams[index]
                deltas = stream.feed(output.delta_text)
                if output.finished:
                    deltas += stream.finish(output.text)
                if not deltas and logprobs is not None and logprobs.content:
                    deltas = [{"content": ""}]
                for delta in deltas:
                    if logprobs is None and is_content_only(delta):  # the steady state
                        yield content_events.event(index, delta["content"])
                    else:
                        yield event(self._chunk([ChatChunkChoice(
                            index=index, delta=delta, logprobs=logprobs)]), with_usage)
                    self.writes.written(index)  # a yield returns once its event was sent
                    logprobs = None  # once per output
                if output.finished:
                    finals[index] = output
                    reason = tool_reason(finish_reason(output), stream.called)
                    yield event(self._chunk([ChatChunkChoice(
                        index=index, delta={}, finish_reason=reason)]), with_usage)
                    self.writes.written(index)
            if with_usage:
                usage = build_usage([self.prompt], [finals[c.index] for c in self.choices])
                yield event(self._chunk([], usage))
            # Observed before [DONE], so a client that scrapes /metrics after it finds it.
            self.writes.observe(set(finals))
            yield DONE
        except Exception as error:
            yield error_event(error)  # and no [DONE]: the stream did not succeed
        finally:
            self.writes.observe(set(finals))
            await fanout.aclose()
