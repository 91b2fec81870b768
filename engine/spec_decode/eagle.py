"""Drafting with an EAGLE head (engine/spec_decode/eagle_head.py) on the target's features.

After every target step the engine hands over the hidden states of the positions that step
settled (`observe_target_step`); the rows the head reads wait on the request until its next
proposal. A proposal then runs the head once over everything waiting (its catch-up: feature f_t
with token t+1, for the positions since the last proposal) and K - 1 more times on its own
predictions. A request that keeps CONVERT_ROWS rows without drafting has them turned into
features without the head running. The head's one-layer KV lives at the target's positions in
the request's own blocks, so the scheduler's block tables and lookahead slots serve it unchanged;
rejected drafts' entries are overwritten by the next catch-up.

Where the request's context holds a copy (an n-gram match of at least `ngram_min` tokens), the
lookup's continuation may be proposed instead: on copy-heavy text it is right more often than the
head and costs nothing to draft. Each request keeps an acceptance tracker per source; a step
drafts from the lookup when it found a match and its recent acceptance is at least the head's,
and the controller sizes K by the tracker of the source chosen (`prepare`), so a long run of
accepted copies gets long drafts while the head's guesses get short ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import build_attention_metadata
from engine.core.device import copy_to_device
from engine.core.request import Request
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE, AcceptanceTracker
from engine.sample.sampler import argmax_rows
from engine.spec_decode.eagle_head import EagleHead
from engine.spec_decode.head_retirement import HEAD_TRACKER, count_step
from engine.spec_decode.model_drafter import sample_drafts
from engine.spec_decode.ngram import NgramLookup
from engine.spec_decode.proposer import Proposal, Proposer

# Kept target rows after which a request's rows become the head's features without the head
# running: an EAGLE-3 head's rows are three times the size (~7 KB a position on the default
# model, against ~2.3 KB), and turning them into features is work the head needs anyway, where
# running the head over them would be wasted on requests that never draft with it.
CONVERT_ROWS = 64


class EagleProposer(Proposer):
    name = "eagle"
    keeps_own_kv = True  # the head's KV, at the target's positions

    def __init__(self, head: EagleHead, target, kv_cache, block_size: int,
                 device: torch.device, shared_generator: torch.Generator | None = None,
                 ngram: tuple[int, int] | None = None, head_prior: float = PRIOR_ACCEPTANCE,
                 retire: bool = False):
        """`ngram`: (max, min) lengths of the n-gram lookup tried first; None: the head only.
        `head_prior`: the head's expected acceptance (the controller's prior for its drafts).
        `retire`: heads that do not pay retire (head_retirement.py), for a controller that
        adapts K; with a fixed K they draft whatever they accept."""
        self.head = head
        self.target = target
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.shared_generator = shared_generator
        self.ngram = ngram
        self.copy_lookup = NgramLookup(*ngram) if ngram else None
        self.num_sequential_steps = 0  # head forwards in the last propose(), for the cost model
        self._copies: dict[str, list[int]] = {}  # this step's lookup drafts, by request id
        self._drafted: set[str] = set()  # this step's requests the head drafted for
        self.head_prior = head_prior
        self.retire = retire

    # ------------------------------------------------------------ target features
    def observe_target_step(self, scheduled, row_starts: Sequence[int], hidden: torch.Tensor,
                            emitted: Sequence[Sequence[int]]) -> None:
        """Keeps the target's rows (the columns the head reads) of every position this step
        settled: a request's new tokens and its accepted drafts (rows from `row_starts[i]` in
        `hidden`). Call before the scheduler advances `num_computed_tokens`. The head's features
        are computed from them when it next runs, for all waiting positions at once: most steps
        never draft with the head, and computing them every step cost ~0.35 ms of a ~5 ms step
        at batch 1 on CPU."""
        rows, runs = [], []
        for s, row_start, tokens in zip(scheduled, row_starts, emitted):
            if s.request.head_retired:
                continue
            if self.retire and s.num_lookahead > 0:  # a decode step: did the head pay?
                count_step(s.request, s.request.request_id in self._drafted, len(tokens) > 1)
                if s.request.head_retired:
                    continue
            settled = s.num_new_tokens + max(len(tokens) - 1, 0)
            if settled:
                rows.extend(range(row_start, row_start + settled))
                runs.append((s.request, s.request.num_computed_tokens, settled))
        self._drafted = set()
        if not rows:
            return
        # One copy for every request (the step's output buffer may be reused when a graph
        # replays), then a view per request: a slice's where one request settled rows (batch
        # 1: no index tensor to build), else a gather.
        columns = self.head.kept_columns(hidden)
        kept = columns[rows[0]:rows[-1] + 1].clone() if len(runs) == 1 \
            else columns.index_select(0, _on(rows, self.device))
        offset = 0
        for request, start, count in runs:
            _keep_features(request, start, kept[offset:offset + count])
            offset += count

    def wants_features(self, requests: Sequence[Request]) -> bool:
        return any(not request.head_retired for request in requests)

    # ----------------------------------------------------------------- proposing
    def prepare(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> None:
        self._copies = {}
        for request, k in zip(requests, max_tokens):
            trackers = request.acceptance_by_source
            if not trackers:
                # Copies start from n-gram lookup's prior, not the head's measured acceptance.
                trackers.update({HEAD_TRACKER: request.acceptance,
                                 "copy": AcceptanceTracker(prior=PRIOR_ACCEPTANCE)})
            copied = self.copy_lookup.continuation(request, k) if self.copy_lookup else []
            head = trackers.get(HEAD_TRACKER)  # None once the head retired
            use_copy = bool(copied) and (
                head is None or trackers["copy"].estimate() >= head.estimate(self.head_prior))
            if use_copy:
                self._copies[request.request_id] = copied
            if head is None:  # the copy lookup alone, or no draft at all
                request.acceptance = trackers["copy"] if use_copy else \
                    trackers.setdefault("none", AcceptanceTracker(prior=0.0))
                continue
            # The source not used drifts back towards the prior, so it is tried again later.
            (head if use_copy else trackers["copy"]).decay()
            request.acceptance = trackers["copy"] if use_copy else head
        self.convert_long_waits(requests)

    def drafts_are_free(self, request: Request) -> bool:
        return request.request_id in self._copies

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = []
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            if k <= 0:
                continue
            copied = self._copies.get(request.request_id)
            if copied:
                drafts[i] = copied[:k]
            elif request.pending_features:
                active.append(i)
        self._copies = {}
        self.num_sequential_steps = 0
        if active:
            self._draft(requests, num_tokens, active, drafts, probs)
        return Proposal(drafts, [torch.stack(q) if q else None for q in probs])

    def _draft(self, requests, num_tokens, active, drafts, probs) -> None:
        drafting = [requests[i] for i in active]
        self._drafted = {request.request_id for request in drafting}
        features, positions = self._take_pending(drafting)
        predicted = self._catch_up(drafting, features, positions)
        lengths = [len(run) for run in positions]
        last_rows = [sum(lengths[:n + 1]) - 1 for n in range(len(lengths))]
        predicted = predicted.index_select(0, _on(last_rows, self.device))
        # The head's prediction at position t is f^_{t+1}: fed back with the draft it chose.
        next_position = {i: run[-1] + 1 for i, run in zip(active, positions)}
        step = 0
        while True:
            picks, q = self._pick_drafts(predicted, [requests[i] for i in active],
                                         [drafts[i] for i in active])
            for i, token, q_row in zip(active, picks, q):
                drafts[i].append(token)
                if q_row is not None:
                    probs[i].append(q_row)
            step += 1
            keep = [n for n, i in enumerate(active) if len(drafts[i]) < num_tokens[i]]
            if not keep:
                break
            active = [active[n] for n in keep]
            draft_positions = [next_position[i] + step - 1 for i in active]
            predicted = self._forward([requests[i] for i in active],
                                      predicted.index_select(0, _on(keep, self.device)),
                                      [drafts[i][-1] for i in active], draft_positions,
                                      [1] * len(active), [p + 1 for p in draft_positions])
        self.num_sequential_steps = step

    def convert_long_waits(self, requests: Sequence[Request]) -> None:
        """Turns the kept rows of requests with CONVERT_ROWS or more into the head's features."""
        self._convert([request for request in requests if _num_raw(request) >= CONVERT_ROWS])

    def _convert(self, requests: Sequence[Request]) -> None:
        """Every kept-row run of these requests becomes the head's features, in one batch."""
        raw = [(request, index) for request in requests
               for index, (_, _, ready) in enumerate(request.pending_features) if not ready]
        if not raw:
            return
        features = self.head.target_features(
            torch.cat([request.pending_features[index][1] for request, index in raw]),
            self.target.norm)
        offset = 0
        for request, index in raw:
            first, rows, _ = request.pending_features[index]
            request.pending_features[index] = (first, features[offset:offset + rows.shape[0]], True)
            offset += rows.shape[0]

    def _catch_up(self, requests, features: torch.Tensor,
                  positions: list[list[int]]) -> torch.Tensor:
        """The head over waiting positions (f_t with token t+1), writing its KV there; [rows, H]
        its predictions f^_{t+1}."""
        token_ids = [request.all_token_ids[p + 1] for request, run in zip(requests, positions)
                     for p in run]
        return self._forward(requests, features, token_ids, [p for run in positions for p in run],
                             [len(run) for run in positions], [run[-1] + 1 for run in positions])

    def _take_pending(self, requests) -> tuple[torch.Tensor, list[list[int]]]:
        """Every request's waiting features (kept rows turned into features now, in one batch),
        concatenated, and each request's positions."""
        self._convert(requests)
        runs, positions = [], []
        for request in requests:
            own = []
            for first, features, _ in request.pending_features:
                runs.append(features)
                own.extend(range(first, first + features.shape[0]))
            positions.append(own)
            request.pending_features = []
        return torch.cat(runs), positions

    def _forward(self, requests, features, token_ids, positions, query_lens, context_lens):
        meta = build_attention_metadata(query_lens, context_lens,
                                        [r.block_table for r in requests],
                                        self.block_size, self.device)
        ids, pos = copy_to_device([torch.tensor(token_ids, dtype=torch.long),
                                   torch.tensor(positions, dtype=torch.long)], self.device)
        return self.head(features, self.head.embed(ids, self.target), pos, self.kv_cache, meta)

    def _pick_drafts(self, predicted: torch.Tensor, requests, drafts_so_far):
        """Each request's next draft from the head's predicted features: (tokens, per request
        its distribution q over the full vocabulary, or None where it decodes greedily)."""
        draft_logits = self.head.draft_logits(predicted)
        if all(r.sampling_params.greedy for r in requests):
            # the argmax within the draft vocabulary, without a full-vocabulary row per draft
            return self.head.token_ids[argmax_rows(draft_logits)].tolist(), [None] * len(requests)
        # Sampled drafts need q over the whole vocabulary: 0 outside the head's tokens.
        full = draft_logits.new_full((draft_logits.shape[0], self.target.arch.vocab_size),
                                     float("-inf"))
        full.index_copy_(1, self.head.token_ids, draft_logits)
        return sample_drafts(full, requests, drafts_so_far, self.device, self.shared_generator)


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    (tensor,) = copy_to_device([torch.tensor(values, dtype=torch.long)], device)
    return tensor


def _keep_features(request: Request, start: int, rows: torch.Tensor) -> None:
    """Appends a run of kept target rows from position `start`, dropping any waiting at or past
    it (a recompute after preemption delivers positions again). Runs stay in position order, so
    only the last ones can reach `start`: a step touches those alone, not every waiting run."""
    pending = request.pending_features
    while pending and pending[-1][0] >= start:
        pending.pop()
    if pending:
        first, run, ready = pending[-1]
        if first + run.shape[0] > start:
            pending[-1] = (first, run[:start - first], ready)
    pending.append((start, rows, False))


def _num_raw(request: Request) -> int:
    """Waiting positions whose rows are not features yet: the last runs, consecutive."""
    pending = request.pending_features
    index = len(pending)
    while index and not pending[index - 1][2]:
        index -= 1
    if index == len(pending):
        return 0
    last_first, last_rows, _ = pending[-1]
    return last_first + last_rows.shape[0] - pending[index][0]
