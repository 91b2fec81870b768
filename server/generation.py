"""From a parsed request to engine requests and back, shared by the completions and chat routes:
sampling parameters, the fan-out of choices into engine requests, the client-disconnect watch and
usage.

Choice `index` is `prompt_index * n + j`, as OpenAI numbers them; each choice is one engine request
(`<response id>-<index>`), so the n choices of a prompt run side by side in the batch and share the
prompt's cached KV blocks.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request

from engine.grammar import Constraint
from engine.metrics.spec_stats import SpecStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.context import ServerContext
from server.errors import bad_request, client_gone
from server.fanout import FanOut
from server.protocol import (
    MethodUsage,
    PromptTokensDetails,
    SamplingFields,
    SpeculativeUsage,
    Usage,
)
from server.streaming import EventStreamResponse

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # None when the prompt came as token ids

    def echo_text(self, tokenizer) -> str:
        if self.text is not None:
            return self.text
        return tokenizer.decode(self.token_ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Choice:
    index: int
    prompt: Prompt
    params: SamplingParams
    request: object = None  # engine.core.request.Request: validated, what the engine runs


def sampling_params(context: ServerContext, body: SamplingFields, prompt: Prompt,
                    requested_max_tokens: int | None, logprobs: int | None,
                    structured: Constraint | None = None) -> SamplingParams:
    """`requested_max_tokens` None fills the rest of the context. Raises APIError or ValueError
    (the engine's range checks) for bad values."""
    if requested_max_tokens is None:
        requested_max_tokens = context.max_sequence_tokens - len(prompt.token_ids)
        if requested_max_tokens < 1:
            raise bad_request(f"this model's maximum context length is {context.max_model_len} "
                              f"tokens, but the prompt has {len(prompt.token_ids)} tokens, which "
                              "leaves no room for output")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or ()
    return SamplingParams(
        max_tokens=requested_max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias, context.engine.vocab_size),
        seed=body.seed, stop=tuple(stop), ignore_eos=body.ignore_eos, logprobs=logprobs,
        structured=structured,
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary "
                              f"[0, {vocab_size})", "logit_bias")
        parsed[token_id] = value
    return parsed


def check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def plan_choices(context: ServerContext, prompts: list[Prompt],
                 params: list[SamplingParams], n: int, cache_salt: str = "") -> list[Choice]:
    """Validates every choice against the engine's limits (a ValueError naming the numbers),
    once: the engine runs the request this makes. A seed moves by the choice's position so the
    n choices differ yet stay reproducible. `cache_salt`: the tenant partition
    (server/tenants.py)."""
    choices = []
    for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
        for j in range(n):
            choice_params = prompt_params
            if prompt_params.seed is not None and j:
                choice_params = replace(prompt_params, seed=prompt_params.seed + j)
            choices.append(Choice(prompt_index * n + j, prompt, choice_params,
                                  context.engine.validate(prompt.token_ids, choice_params,
                                                          cache_salt=cache_salt)))
    return choices


class ClientDisconnected(Exception):
    pass


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work` while watching the connection; a client that goes away cancels it (raising
    ClientDisconnected) instead of letting it run to the end for nobody."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            # Let the cancellation run before asking how the task ended: right after cancel()
            # it is neither cancelled nor done, and result() raises InvalidStateError.
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(request: Request, context: ServerContext, response, choices: list[Choice],
                  stream: bool):
    """Runs the choices and answers: an SSE stream of `response.events`, or, once every choice
    has finished, `response.complete` (nothing at all if the client left first). Either way the
    engine requests end with the response. `complete` may be a coroutine (the Responses API
    stores the response before answering)."""
    fanout = FanOut(context, response.id, choices, final_only=not stream)
    if stream:
        return EventStreamResponse(response.events(fanout), on_close=fanout.aclose,
                                   stall_timeout_s=context.settings.stream_stall_timeout_s)
    try:
        finals = await run_unless_disconnected(request, fanout.finals())
    except ClientDisconnected:
        return client_gone().response()
    finally:
        await fanout.aclose()
    result = response.complete(finals)
    return await result if inspect.isawaitable(result) else result


def requested_max_tokens(body: SamplingFields) -> int | None:
    """`max_completion_tokens` (the newer name) wins over `max_tokens`."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def build_usage(prompts: list[Prompt], finals: list[RequestOutput]) -> Usage:
    """`finals` in choice order, n per prompt. A prompt counts once, as OpenAI counts it, and so
    do its cached tokens: those its first choice found (its other choices start after it has
    prefilled, so they find the whole prompt cached)."""
    stats = SpecStats()
    for final in finals:
        stats.merge(final.spec_stats)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(final.token_ids) for final in finals)
    n = len(finals) // max(len(prompts), 1)
    cached_tokens = sum(final.num_cached_tokens for final in finals[::n]) if n else 0
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        speculative=SpeculativeUsage(
            num_drafts=stats.num_drafts, draft_tokens=stats.num_draft_tokens,
            accepted_tokens=stats.num_accepted_tokens,
            mean_acceptance_length=round(stats.mean_acceptance_length, 4),
            by_method={method: MethodUsage(
                draft_tokens=drafts, accepted_tokens=stats.accepted_tokens_by_method[method],
                acceptance_rate=round(stats.accepted_tokens_by_method[method] / drafts, 4))
                for method, drafts in stats.draft_tokens_by_method.items() if drafts}),
    )


def finish_reason(output: RequestOutput) -> str | None:
    """"stop", "length", or "abort" (vLLM's word) for a request the server ended: a graceful
    drain's deadline. A client's own disconnect also aborts, but nobody reads that answer."""
    return output.finish_reason if output.finished else None
