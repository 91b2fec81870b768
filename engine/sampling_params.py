"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass

from engine.grammar.constraint import Constraint

MAX_LOGPROBS = 20
# Below this temperature a request is greedy, as in vLLM: dividing logits by it overflows float32
# (1e-300 even rounds to 0), and the law it tends to is the argmax.
GREEDY_BELOW = 1e-5
# Temperatures and repetition penalties are held in this range. Outside it float32 arithmetic
# overflows to inf and NaN (inf / inf, 0 * inf), and sampling returns noise; inside it logits
# up to 1e7 stay finite, and the law is already its limit to float32 precision: uniform over
# the allowed tokens for a huge temperature, all mass on the seen tokens for a tiny penalty.
FLOAT32_SAFE = (1e-30, 1e30)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature 0 means greedy. `top_k` <= 0 and `top_p` == 1 disable those filters. Presence and
    frequency penalties apply to generated tokens (OpenAI), the repetition penalty to prompt and
    generated tokens (Hugging Face / vLLM). `logprobs` is the number of top alternatives to report
    beside the chosen token's own log-probability (None: no logprobs at all).

    A temperature below GREEDY_BELOW is stored as 0 (greedy); temperatures and repetition
    penalties beyond FLOAT32_SAFE are held at its ends (see there why).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: Constraint | None = None  # the output must match this (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        # Accept lists / single strings from callers, store tuples so the object stays hashable-ish.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (not (self.structured and self.ignore_eos),
             "ignore_eos cannot be combined with structured output: the grammar ends the text"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        low, high = FLOAT32_SAFE
        temperature = 0.0 if self.temperature < GREEDY_BELOW else min(self.temperature, high)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "repetition_penalty",
                           min(max(self.repetition_penalty, low), high))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
