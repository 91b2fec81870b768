"""One generation request and the state the engine keeps for it.

Each field has one writer: the block manager writes `block_table` and `block_hashes`; the scheduler
writes `status`, `num_computed_tokens`, `output_token_ids` and the counters; the engine writes the
detokenizer state and timings.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.metrics.spec_stats import AcceptanceTracker, SpecStats
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context limit
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a failure of this request alone (its grammar, its logits)

    @property
    def finished(self) -> bool:
        # read for every request several times a step: an attribute, not a set lookup (an
        # enum member's hash is a Python-level call)
        return self._finished


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
for _status in RequestStatus:
    _status._finished = _status in _FINISHED


@dataclass(eq=False)  # identity, not field equality: two requests are never the same
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt_text: str | None = None  # None when the prompt came as token ids
    # When the request arrived: its HTTP route's entry for a served request (writer: the server,
    # before the engine sees it), else its creation. TTFT and end-to-end latency count from it.
    arrival_time: float = field(default_factory=time.monotonic)
    # The tenant partition of what the engine caches across requests: prefix-cache blocks and
    # the suffix proposer's global trie are only shared between requests with equal salts (the
    # server joins the API key's identity and the request's `cache_salt`).
    cache_salt: str = ""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache and valid. Tokens past it are still to be fed to the model.
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    # Output tokens at the end still in flight on the device (engine/runner/overlap.py PLACEHOLDER):
    # sampled by a launched step, not read back yet (writer: the engine).
    num_placeholder_tokens: int = 0

    # Speculation. Drafts for this step (writer: the engine, from the proposer); the draft model's
    # own KV progress (writer: the draft-model proposer; reset on preemption by the scheduler);
    # counters (writer: the scheduler); recent acceptance (writer: the speculation controller).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_method: str = ""  # the method that proposed them (writer: the speculation step)
    num_draft_computed_tokens: int = 0
    # What the EAGLE head has not read yet, as (first position, rows, rows are features) runs:
    # the target's kept rows, or the head's features made of them (writer: the eagle proposer).
    pending_features: list[tuple[int, object, bool]] = field(default_factory=list)
    # The head no longer drafts for this request, so its features are not kept (writer: the
    # eagle proposer, head_retirement.py); decode steps that added nothing since a head draft
    # was last accepted.
    head_retired: bool = False
    head_idle_steps: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    # A proposer with several sources (eagle: copy lookup, head) keeps one tracker per source
    # and points `acceptance` at the one this step drafts from (writer: that proposer).
    acceptance_by_source: dict[str, AcceptanceTracker] = field(default_factory=dict)
    # Steps this request's drafts are not even computed, after the controller planned none
    # for it, and the rest it gets the next time (doubling; writer: the controller).
    draft_rest_left: int = 0
    draft_rest: int = 0

    # Structured output: the request's grammar state, advanced by emitted tokens only (writer:
    # the engine). `forced_drafts`: per draft of this step, whether the grammar forced it rather
    # than the proposer guessing it (writer: the speculation step).
    grammar: object | None = None  # engine.grammar.GrammarMatcher
    forced_drafts: list[bool] = field(default_factory=list)
    # Times generated tokens were taken back (truncate_output): what was derived from the
    # context so far (the n-gram index) is stale when it changes.
    num_truncations: int = 0

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the leading full blocks
    # Leading blocks given back behind a sliding window (their table entries are placeholders)
    num_released_blocks: int = 0

    # The front's stamps (writer: the server; None offline): chat template rendered, prompt
    # tokenized, handed to the engine. Queue time counts from `queued_time` when it is set.
    rendered_time: float | None = None
    tokenized_time: float | None = None
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it failed, with status FINISHED_ERROR (writer: the engine)

    # prompt + output, kept as one list so hot paths need not concatenate.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops generated tokens past the first `num_output_tokens` (a stop string ended the
        text inside a run of accepted drafts)."""
        if num_output_tokens < len(self.output_token_ids):
            self.num_truncations += 1
            removed = len(self.output_token_ids) - num_output_tokens
            self.num_placeholder_tokens = max(0, self.num_placeholder_tokens - removed)
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
