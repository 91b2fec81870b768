"""`POST /v1/completions`: text in, text out (OpenAI's legacy completions API)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, BackgroundTasks, Depends, Request

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
from server.logprobs import CompletionLogprobsBuilder, TokenTexts, merge_completion_logprobs
from server.prompt_tokens import run_by_size
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from server.sse_chunks import TextChunks
from server.streaming import DONE, error_event, event
from server.structured import prepare_constraint
from server.tenants import cache_partition
from server.timeline import FrontClock, WriteClock

router = APIRouter(dependencies=[Depends(require_api_key)])
# About what one echoed prompt token adds to `logprobs` (its text, a null logprob, a null
# top_logprobs entry and its offset, in JSON).
ECHO_LOGPROB_BYTES = 32


@router.post("/v1/completions")
async def create_completion(request: Request, background: BackgroundTasks,
                            context: ServerContext = Depends(get_context)):
    clock = FrontClock.since_arrival(request.scope)
    body = await parse_body(request, CompletionRequest)
    context.check_model(body.model)
    check_stream_options(body)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported: leave it out or make it equal to n",
                          "best_of")
    num_prompts = _num_prompts(body.prompt)
    context.admission.check_size(num_prompts * body.n, f"{num_prompts} prompts x n={body.n}")
    tokenizer = context.engine.tokenizer
    prompts = await run_by_size(lambda: _tokenize(tokenizer, body.prompt),
                                _num_chars(body.prompt))
    clock.mark_tokenized()
    if body.echo:
        echoed = await asyncio.to_thread(_echo_bytes, tokenizer, prompts, body)
        if echoed > context.settings.max_request_bytes:
            raise bad_request(
                f"echo would send back {echoed} bytes of prompt ({body.n} copies of each); the "
                f"server echoes at most {context.settings.max_request_bytes}, as much as it "
                "takes in (--max-request-bytes): ask with a smaller n, or without echo", "echo")
    requested = requested_max_tokens(body)  # None: the default for this endpoint
    structured = await prepare_constraint(context, body)
    params = [sampling_params(context, body, prompt, requested, body.logprobs, structured)
              for prompt in prompts]
    choices = plan_choices(context, prompts, params, body.n,
                           cache_partition(request, body.cache_salt))
    response = _Response(context, body, prompts, choices)
    clock.hand_over(choices)
    if not body.stream:  # background tasks run once the response's body has been sent
        background.add_task(response.writes.written_whole_and_observe)
    return await respond(request, context, response, choices, body.stream)


def _echo_bytes(tokenizer, prompts: list[Prompt], body: CompletionRequest) -> int:
    """What echo adds to the response: each prompt's text, and with logprobs an entry per
    prompt token, in every one of its n choices. Unbounded, a short request of token ids
    could ask for hundreds of times its size back."""
    per_choice = sum(len(p.echo_text(tokenizer).encode())
                     + (ECHO_LOGPROB_BYTES * len(p.token_ids) if body.logprobs is not None else 0)
                     for p in prompts)
    return per_choice * body.n


def _num_prompts(prompt) -> int:
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def _num_chars(prompt) -> int:
    """The text to tokenize in a prompt of any of OpenAI's four forms (token ids need none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def _tokenize(tokenizer, prompt) -> list[Prompt]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    return [Prompt(tokenizer(p)["input_ids"], p) if isinstance(p, str) else Prompt(list(p))
            for p in prompt]


class _Response:
    """Builds one completion response, whole or as a stream of chunks."""

    def __init__(self, context: ServerContext, body: CompletionRequest, prompts: list[Prompt],
                 choices: list[Choice]):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.context = context
        self.body = body
        self.prompts = prompts
        self.choices = choices
        self.texts = TokenTexts(context.engine.tokenizer)
        self.writes = WriteClock(context, choices)

    def _chunk(self, choices: list[CompletionChoice], usage=None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.context.model_name,
                                  choices=choices, usage=usage)

    def _text_chunk(self, index: int, text: str) -> CompletionResponse:
        return self._chunk([CompletionChoice(index=index, text=text)])

    def complete(self, finals: dict) -> CompletionResponse:
        body, tokenizer = self.body, self.context.engine.tokenizer
        out = []
        for choice in self.choices:
            final = finals[choice.index]
            text, logprobs = final.text, None
            if body.echo:
                text = choice.prompt.echo_text(tokenizer) + text
            if body.logprobs is not None:
                builder = CompletionLogprobsBuilder(self.texts)
                parts = [builder.prompt(choice.prompt.token_ids)] if body.echo else []
                parts.append(builder.generated(final.logprobs or []))
                logprobs = merge_completion_logprobs(parts)
            out.append(CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                        finish_reason=finish_reason(final)))
        usage = build_usage(self.prompts, [finals[c.index] for c in self.choices])
        return self._chunk(out, usage)

    async def events(self, fanout: FanOut) -> AsyncGenerator[str, None]:
        body, tokenizer = self.body, self.context.engine.tokenizer
        with_usage = body.include_usage
        by_index = {choice.index: choice for choice in self.choices}
        builders = {index: CompletionLogprobsBuilder(self.texts) for index in by_index}
        started, finals = set(), {}
        text_events = TextChunks(self._text_chunk, with_usage)
        try:
            async for index, output in fanout:
                self.writes.tokens_ready(index, output)
                choice, builder = by_index[index], builders[index]
                text, parts = output.delta_text, []
                if index not in started:
                    started.add(index)
                    if body.echo:
                        text = choice.prompt.echo_text(tokenizer) + text
                        parts.append(builder.prompt(choice.prompt.token_ids))
                logprobs = None
                if body.logprobs is not None:
                    parts.append(builder.generated(output.delta_logprobs or []))
                    logprobs = merge_completion_logprobs(parts)
                rendered = None
                if logprobs is None and text:  # the steady state
                    rendered = text_events.event(index, text)
                elif text or (logprobs is not None and logprobs.tokens):
                    rendered = event(self._chunk([CompletionChoice(index=index, text=text,
                                                                   logprobs=logprobs)]), with_usage)
                if rendered is not None:
                    yield rendered
                    self.writes.written(index)  # a yield returns once its event was sent
                if output.finished:
                    finals[index] = output
                    yield event(self._chunk([CompletionChoice(
                        index=index, text="", finish_reason=finish_reason(output))]), with_usage)
                    self.writes.written(index)
            if with_usage:
                usage = build_usage(self.prompts, [finals[c.index] for c in self.choices])
                yield event(self._chunk([], usage))
            # Observed before [DONE], so a client that scrapes /metrics after it finds it.
            self.writes.observe(set(finals))
            yield DONE
        except Exception as error:
            yield error_event(error)  # and no [DONE]: the stream did not succeed
        finally:
            self.writes.observe(set(finals))
            await fanout.aclose()
