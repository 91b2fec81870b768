"""Speculation counters as plain data, per request and per engine (exported by the metrics layer).

`num_drafts` counts verify steps that carried at least one draft token (vLLM's meaning);
`accepted_per_position[i]` counts steps whose draft at position i was accepted, so a step that
accepts a drafts adds one to positions 0..a-1 and the list never increases along positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # the bonus / recovered token is not counted
    num_emitted_tokens: int = 0  # accepted + the one sampled token, per verify step
    accepted_per_position: list[int] = field(default_factory=list)
    # Of the above, drafts a grammar forced (structured output) and how many were accepted.
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0
    # Guessed (not forced) draft tokens and their accepted ones, by the method that proposed
    # them ("ngram", "suffix", ...): acceptance per method.
    draft_tokens_by_method: dict[str, int] = field(default_factory=dict)
    accepted_tokens_by_method: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> "SpecStats":
        """A copy to subtract from later (taken every engine step: copy.deepcopy cost ~40 us)."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position),
                                   draft_tokens_by_method=dict(self.draft_tokens_by_method),
                                   accepted_tokens_by_method=dict(self.accepted_tokens_by_method))

    def record_method(self, method: str, num_draft_tokens: int, num_accepted: int) -> None:
        drafts, accepted = self.draft_tokens_by_method, self.accepted_tokens_by_method
        drafts[method] = drafts.get(method, 0) + num_draft_tokens
        accepted[method] = accepted.get(method, 0) + num_accepted

    def method_acceptance(self) -> dict[str, float]:
        """Accepted over guessed draft tokens, per method that drafted."""
        return {method: self.accepted_tokens_by_method.get(method, 0) / drafts
                for method, drafts in self.draft_tokens_by_method.items() if drafts}

    def record_forced(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_forced_draft_tokens += num_draft_tokens
        self.num_forced_accepted_tokens += num_accepted

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.record_forced(other.num_forced_draft_tokens, other.num_forced_accepted_tokens)
        for method, drafts in other.draft_tokens_by_method.items():
            self.record_method(method, drafts, other.accepted_tokens_by_method.get(method, 0))
        extra = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(extra, 0))
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the sampled one (1.0 = no gain)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 1.0
DECAY = 0.95  # per step: a memory of about 20 draft trials


@dataclass
class AcceptanceTracker:
    """Decayed counts of accepted drafts and of draft trials (accepted + first rejections)."""

    accepted: float = 0.0
    trials: float = 0.0
    prior: float | None = None  # this source's own prior, over the one the caller passes

    def estimate(self, prior: float = PRIOR_ACCEPTANCE) -> float:
        prior = self.prior if self.prior is not None else prior
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.decay()
        self.accepted += num_accepted
        # The geometric model's trials: every accepted draft plus the one that was rejected.
        self.trials += num_accepted + (1 if num_accepted < num_drafts else 0)

    def decay(self) -> None:
        self.accepted *= DECAY
        self.trials *= DECAY
