"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, a reply out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Depends, Request

from server.context import ServerContext, get_context, require_api_key
from server.errors import bad_request, parse_body
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
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from server.streaming import DONE, error_event, event

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, context: ServerContext = Depends(get_context)):
    body = await parse_body(request, ChatCompletionRequest)
    context.check_model(body.model)
    check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    prompt = await asyncio.to_thread(_apply_chat_template, context.engine.tokenizer, body)
    requested = requested_max_tokens(body)  # None: the default for this endpoint
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(context, body, prompt, requested, num_logprobs)
    choices = plan_choices(context, [prompt], [params], body.n)
    response = _Response(context, body, prompt, choices)
    return await respond(request, context, response, choices, body.stream)


def _apply_chat_template(tokenizer, body: ChatCompletionRequest) -> Prompt:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=body.add_generation_prompt)
    # The template writes any special tokens itself (a BOS among them): add none twice.
    return Prompt(tokenizer(text, add_special_tokens=False)["input_ids"], text)


class _Response:
    """Builds one chat completion, whole or as a stream of chunks."""

    def __init__(self, context: ServerContext, body: ChatCompletionRequest, prompt: Prompt,
                 choices: list[Choice]):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.context = context
        self.body = body
        self.prompt = prompt
        self.choices = choices
        self.texts = TokenTexts(context.engine.tokenizer)
        self.num_top = body.top_logprobs or 0

    def _logprobs(self, logprobs):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.texts, logprobs or [], self.num_top)

    def complete(self, finals: dict) -> ChatCompletionResponse:
        out = [ChatChoice(index=c.index,
                          message=AssistantMessage(content=finals[c.index].text),
                          logprobs=self._logprobs(finals[c.index].logprobs),
                          finish_reason=finish_reason(finals[c.index]))
               for c in self.choices]
        usage = build_usage([self.prompt], [finals[c.index] for c in self.choices])
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.context.model_name, choices=out, usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created,
                                   model=self.context.model_name, choices=choices, usage=usage)

    async def events(self, fanout: FanOut) -> AsyncGenerator[str, None]:
        with_usage = self.body.include_usage
        finals = {}
        try:
            for choice in self.choices:  # the role first, before any token is ready
                yield event(self._chunk([ChatChunkChoice(
                    index=choice.index, delta={"role": "assistant", "content": ""})]), with_usage)
            async for index, output in fanout:
                logprobs = self._logprobs(output.delta_logprobs)
                if output.delta_text or (logprobs is not None and logprobs.content):
                    yield event(self._chunk([ChatChunkChoice(
                        index=index, delta={"content": output.delta_text}, logprobs=logprobs)]),
                        with_usage)
                if output.finished:
                    finals[index] = output
                    yield event(self._chunk([ChatChunkChoice(
                        index=index, delta={}, finish_reason=finish_reason(output))]), with_usage)
            if with_usage:
                usage = build_usage([self.prompt], [finals[c.index] for c in self.choices])
                yield event(self._chunk([], usage))
            yield DONE
        except Exception as error:
            yield error_event(error)
            yield DONE
        finally:
            await fanout.aclose()
