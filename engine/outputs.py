"""What the engine hands back for a request after a step: cumulative state plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics.spec_stats import SpecStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives, best first

    @classmethod
    def from_sampler(cls, token_id: int, row: int, out) -> "TokenLogprob":
        """Row `row` of a sampler.SamplerOutput, for the token actually emitted there."""
        top = []
        if out.top_token_ids is not None:
            top = list(zip(out.top_token_ids[row].tolist(), out.top_logprobs[row].tolist()))
        return cls(token_id, float(out.logprobs[row]), top)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # all visible output text so far (a matched stop string excluded)
    # every generated token id, on the final output only: a step's output carries its delta
    # (copying the whole list every step made a request's outputs O(n^2))
    token_ids: list[int]
    delta_text: str  # text that became visible in this step
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    prompt: str | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)  # this request's speculation
    error: str | None = None  # why the request failed (finish_reason "error"), for its client
