"""A step's tokens turned into a request's `RequestOutput`: text (incremental, cut at a stop
string), logprobs, and the grammar's advance, which checks every emitted token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import Request, RequestStatus
from engine.grammar import GrammarError
from engine.outputs import RequestOutput, TokenLogprob
from engine.sample.sampler import compute_logprobs


@dataclass
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    prompt: str | None
    logprobs: list[TokenLogprob] | None


def emit(state: RequestState, scheduler, num_before: int, row_start: int,
         logits: torch.Tensor, now: float, new_ids: list[int]) -> RequestOutput:
    """The request's output after a step: `new_ids`, its tokens from output position
    `num_before`. Raises GrammarError for a token its grammar does not allow (never while masks
    hold)."""
    request = state.request
    if new_ids:
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
    delta_text = ""
    for count, token_id in enumerate(new_ids, start=1):
        delta_text += state.detokenizer.append([token_id])
        if state.detokenizer.stop_reason is not None:
            # A stop string inside a run of accepted drafts: drop the tokens after it.
            new_ids = new_ids[:count]
            scheduler.finish(request, RequestStatus.FINISHED_STOPPED,
                             num_output_tokens=num_before + count)
            request.stop_reason = state.detokenizer.stop_reason
            break
    if request.grammar is not None and new_ids and not request.grammar.accept(new_ids):
        raise GrammarError(f"the output broke its grammar at tokens {new_ids}")
    if request.is_finished and state.detokenizer.stop_reason is None:
        delta_text += state.detokenizer.flush()
    delta_logprobs = None
    if state.logprobs is not None and new_ids:
        rows = logits[row_start:row_start + len(new_ids)]
        out = compute_logprobs(rows, torch.tensor(new_ids, device=rows.device),
                               request.sampling_params.logprobs)
        delta_logprobs = [TokenLogprob.from_sampler(t, i, out) for i, t in enumerate(new_ids)]
        state.logprobs.extend(delta_logprobs)
    return build_output(state, new_ids, delta_text, delta_logprobs)


def build_output(state: RequestState, delta_ids, delta_text, delta_logprobs) -> RequestOutput:
    request = state.request
    finished = request.is_finished
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        text=state.detokenizer.text,
        token_ids=list(request.output_token_ids) if finished else [],
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        finished=finished,
        finish_reason=request.status.value if finished else None,
        stop_reason=request.stop_reason,
        logprobs=state.logprobs,
        delta_logprobs=delta_logprobs,
        num_cached_tokens=request.num_cached_prompt_tokens,
        num_preemptions=request.num_preemptions,
        prompt=state.prompt,
        spec_stats=request.spec_stats,
        error=request.error,
    )
