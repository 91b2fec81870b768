"""`POST /tokenize` and `POST /detokenize`, in vLLM's shape.

`/tokenize` takes a `prompt` (tokenized as completions tokenize it; `add_special_tokens` defaults to
true) or `messages` (through the chat template, in its renderer under its limits, as chat renders
them; `add_special_tokens` defaults to false since the template writes them). It answers `count`,
`max_model_len`, `tokens` and, with `return_token_strs`, `token_strs`. A prompt longer than the
context is counted, not refused: knowing its length is what the client asks.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, StrictInt, StrictStr

from server.chat import render_prompt
from server.context import ServerContext, get_context, require_api_key
from server.errors import bad_request, parse_body
from server.prompt_tokens import tokenize_text
from server.protocol import ChatCompletionRequest, ChatMessage, Tool, _Request
from server.tools import plan_tools

router = APIRouter(dependencies=[Depends(require_api_key)])


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # with messages: rendered as chat renders them
    add_generation_prompt: bool = True  # with messages
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(request: Request, context: ServerContext = Depends(get_context)):
    body = await parse_body(request, TokenizeRequest)
    context.check_model(body.model)
    tokenizer = context.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages",
                          "prompt" if body.prompt is not None else "messages")
    if body.prompt is not None:
        special = body.add_special_tokens is not False
        ids = await tokenize_text(tokenizer, body.prompt, add_special_tokens=special)
    else:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     add_generation_prompt=body.add_generation_prompt)
        prompt = await render_prompt(context, chat, plan_tools(chat))
        ids = prompt.token_ids
        if body.add_special_tokens:
            ids = await tokenize_text(tokenizer, prompt.text, add_special_tokens=True)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=context.max_model_len, tokens=ids,
                            token_strs=strs)


@router.post("/detokenize")
async def detokenize(request: Request, context: ServerContext = Depends(get_context)):
    body = await parse_body(request, DetokenizeRequest)
    context.check_model(body.model)
    tokenizer = context.engine.tokenizer
    size = len(tokenizer)
    for index, token_id in enumerate(body.tokens):
        if token_id >= size:
            raise bad_request(f"token id {token_id} is outside the vocabulary [0, {size})",
                              f"tokens.{index}")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
