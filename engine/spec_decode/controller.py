"""How many tokens to speculate: per request from its recent acceptance, per step from cost.

Model. A request whose drafts are accepted with probability a each gains a^i expected tokens from
its i-th draft. A step costs about t(u) = fixed + per_unit * u for u row units: its rows on the
measured curve over row counts and their attention over their keys (step_cost.py; fitted online
from measured steps). Drafting costs time per token (n-gram lookup) or per sequential draft step
(a draft model). The controller starts every request at K = 0, lines draft tokens up one at a
time, always the likeliest next draft first, and gives out the number of them that makes the
step's expected tokens per second highest. So speculation switches itself off for requests whose
drafts keep failing, and for batches so large that verifying costs more than it returns.

A request's acceptance is tracked with decayed counts that drift back towards a prior when it is
not speculating, so a request that was switched off probes again now and then.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from engine.core.request import Request
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE
from engine.spec_decode.step_cost import DraftCost, LinearCostModel, ModelDraftCost, attended_keys
from engine.spec_decode.step_periods import NoDraftPrice, host_seconds, no_draft_seconds

MIN_DRAFT_GAIN = 0.02  # expected tokens below which a draft position is not even reserved
# Steps without a draft after which one draft goes out anyway. The cost fit learns a verified
# token's price only from steps that feed more tokens than they have requests; with drafting off
# every step feeds one per request, so a slope overestimated once (a noisy step) would keep
# drafting off for good. A probe every 32 steps costs < 1% of a step's rows at batch 1.
PROBE_EVERY = 32
# A probe that drafts with a model also pays that draft: `layer-skip` runs 27 of the default
# model's 30 layers for one, most of a step. Its probes are spaced so that their drafting takes
# at most this share of the steps' time (with every kernel at AVX2, AMD EPYC Zen 4, its probes
# every 32 steps cost chat at batch 1 ~1-2%). The row's own price does not space them: an
# overestimated one is what probes are there to correct.
PROBE_DRAFT_BUDGET = 0.01
# How much more expected tokens per second than no draft a plan must promise before it drafts.
# The price of a row is measured and fitted, so within a few percent; where a plan promises less,
# it may as well lose. On CPU at 16 concurrent requests (AMD EPYC Zen 4, 2 vCPUs) a verified
# row costs 80-90% of what a decoded one does (16 rows 11.0 ms, 32 rows 20.7, 256 rows 176:
# benchmarks/experiments/step_rows.py), so drafts accepted 70-90% of the time promised a few
# percent and lost 5-20% in the server. At batch 1 a row costs a sixth of a step (4.0 ms for 1
# row), and plans promise far more than this.
MIN_PLAN_GAIN = 0.05
# Plans that gave a request likely to accept long drafts (an estimate of at least
# LONG_PROBE_ACCEPTANCE) fewer than its ceiling, after which one plan gives it the ceiling. The
# step-cost model learns a row's price only from the steps it sees. Where its start-up row curve
# came out wrong (measured while this host ran multi-row steps ~1.5x slower: AMD EPYC Zen 4,
# 2 vCPUs), its fit priced rows 2.6x too dear, planned 4 drafts where 15 paid, and never saw a
# step long enough to learn otherwise (docs/performance/agentic.md). Drafts that likely are
# nearly all accepted, so the probe costs little even where rows are dear.
LONG_PROBE_EVERY = 16
LONG_PROBE_ACCEPTANCE = 0.9
# A request planned no draft rests: its drafts are not computed for 1, 2, 4, ... steps (at most
# this), where lookups and planning for 16 requests cost ~2 ms of a ~20 ms step on CPU and made
# `auto` 0.86-0.93x `none` on traffic it did not draft for. At batch 1 the step is shortest, so
# the same work weighs most there: with every kernel at AVX2 (AMD EPYC Zen 4) a lone `ngram`
# request's plan and lookup took ~40 us and the step-cost fit ~23 us of a ~4.5 ms step. A step
# in which every request rests skips them all (speculation.py).
MAX_DRAFT_REST = 8


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool, step_cost: LinearCostModel,
                 draft_cost: DraftCost | ModelDraftCost,
                 prior_acceptance: float = PRIOR_ACCEPTANCE):
        self.max_k, self.prior_acceptance, self.adaptive = max_k, prior_acceptance, adaptive
        self.step_cost = step_cost  # seconds for a target step of u row units
        self.draft_cost = draft_cost
        self.probe_every = PROBE_EVERY  # 0: never probe
        self._plans_without_drafts = 0
        self.long_probe_every = LONG_PROBE_EVERY  # 0: never
        self._plans_kept_short = 0
        self.max_rest = MAX_DRAFT_REST  # 0: requests never rest
        self.min_plan_gain = MIN_PLAN_GAIN
        self.no_draft: NoDraftPrice | None = None  # quiet steps' prices, set before each plan

    def lookahead(self, request: Request) -> int:
        """KV slots the scheduler reserves for this request's drafts: an upper bound on what
        `plan` can give it, without reserving slots for drafts that would gain < 2% of a token."""
        if not self.adaptive or request.grammar is not None:
            # A grammar's forced drafts are always accepted and cost no drafting: a grammar
            # request may fill every slot with them, whatever its guesses' acceptance.
            return self.max_k
        trackers = request.acceptance_by_source.values() or [request.acceptance]
        # Several sources (eagle): reserve for the best, the step may draft from any of them.
        estimate = max(t.estimate(self.prior_acceptance) for t in trackers)
        # at least one slot, so the request can probe
        return max(1, min(self.max_k, _useful_drafts(estimate)))

    def plan(self, requests: Sequence[Request], max_ks: Sequence[int],
             num_other_units: float,
             padded_tokens: Callable[[int], int] | None = None,
             free: Sequence[bool] | None = None,
             num_other_rows: int | None = None,
             positions: Sequence[int] | None = None) -> list[int]:
        """Draft tokens per request for this step. `num_other_units`: what the rows fed anyway cost
        (each request's last token, its attention and its cache read; step_cost.py). A draft row of
        request r is priced by its attention over r's context (`LinearCostModel.draft_units`): at 16
        concurrent agent loops re-sending long histories, a row priced at a short context's cost
        looked half as dear as it is, and drafts lost to no speculation. `num_other_rows`: those
        rows (default: one per request planned); a draft's row costs what the step's measured curve
        says the next row costs (the 17th of a step dear, the ones after it cheap:
        step_cost.RowShape). Other requests' prefill chunks in the same step are left out: their
        work is paid once per prompt however many steps decoding takes, so it is no part of what a
        draft saves (a step's fixed cost is, per step); counted as decode rows, a chunk made the
        step look so slow that any draft seemed to pay, and 16 concurrent agent loops, re-sending
        their histories, ran at 0.86x `none`. `padded_tokens`, for a step that will run padded
        (static_runner.py): the rows it computes when its longest request drafts L tokens.
        `free[i]`: request i's drafts cost no drafting this step (an EAGLE request proposing a
        copy), only their verified rows. `positions[i]`: where request i's fed token sits, its
        drafts after it (default: its computed tokens; a prompt's last chunk feeds more than one
        token before its drafts: prefill_drafts.py)."""
        if not self.adaptive:
            return list(max_ks)
        estimates = [r.acceptance.estimate(self.prior_acceptance) for r in requests]
        free = list(free) if free is not None else [False] * len(requests)
        if positions is None:
            positions = [r.num_computed_tokens for r in requests]
        if padded_tokens is not None:
            ks = self._plan_by_depth(positions, estimates, max_ks, num_other_units,
                                     padded_tokens, free)
        else:
            rows = len(requests) if num_other_rows is None else num_other_rows
            ks = self._plan_greedy(positions, estimates, max_ks, num_other_units, rows, free)
        ks = self._probe_now_and_then(ks, estimates, max_ks, num_other_units)
        ks = self._probe_long_now_and_then(requests, ks, estimates, max_ks)
        for request, k in zip(requests, ks):
            if k == 0:
                request.acceptance.decay()  # drift back towards the prior, to probe later
        return ks

    def resting(self, requests: Sequence[Request]) -> list[bool]:
        """Which requests sit this step out (no lookup, no plan); counts their rest down. A
        resting request's acceptance drifts towards the prior as a plan of no draft makes it."""
        resting = []
        for request in requests:
            rests = request.draft_rest_left > 0  # after_plan never rests a grammar request
            if rests:
                request.draft_rest_left -= 1
                request.acceptance.decay()
            resting.append(rests)
        return resting

    def rested_step(self) -> None:
        """A step in which every request rested (no plan): it counts towards the next probe
        as a plan of no draft does, so probes come every PROBE_EVERY steps, rests or not."""
        self._plans_without_drafts += 1

    def after_plan(self, requests: Sequence[Request], max_ks: Sequence[int],
                   ks: Sequence[int]) -> None:
        """A request that could draft and was planned none rests, each time twice as long."""
        longest = self.max_rest if self.adaptive else 0
        for request, max_k, k in zip(requests, max_ks, ks):
            if max_k <= 0 or request.grammar is not None:
                continue
            if k > 0 or not longest:
                request.draft_rest = 0
            else:
                request.draft_rest = min(max(1, 2 * request.draft_rest), longest)
                request.draft_rest_left = request.draft_rest

    def _probe_now_and_then(self, ks: list[int], estimates: Sequence[float],
                            max_ks: Sequence[int], num_other_units: float) -> list[int]:
        """After `probe_every` plans without a draft (more where drafting one token is dear:
        PROBE_DRAFT_BUDGET), one draft for the likeliest request, so the step-cost fit sees a
        verified token's price again (see PROBE_EVERY)."""
        if any(ks):
            self._plans_without_drafts = 0
            return ks
        self._plans_without_drafts += 1
        candidates = [i for i, m in enumerate(max_ks) if m > 0]
        if not self.probe_every or not candidates \
                or self._plans_without_drafts < self._probe_interval(num_other_units):
            return ks
        self._plans_without_drafts = 0
        probe = list(ks)
        probe[max(candidates, key=lambda i: estimates[i])] = 1
        return probe

    def _probe_interval(self, num_other_units: float) -> float:
        """Plans without a draft between probes: `probe_every`, or as many as keep one token's
        drafting within PROBE_DRAFT_BUDGET of the steps' time."""
        step = self.step_cost(num_other_units)
        drafting = self.draft_cost(1, 1)
        return max(self.probe_every, drafting / (PROBE_DRAFT_BUDGET * step) if step > 0 else 0)

    def _probe_long_now_and_then(self, requests: Sequence[Request], ks: list[int],
                                 estimates: Sequence[float], max_ks: Sequence[int]) -> list[int]:
        """After `long_probe_every` plans that kept a likely request short of its ceiling, one
        plan gives the likeliest of them the ceiling, so the step-cost fit sees long steps
        again (see LONG_PROBE_EVERY)."""
        short = [i for i, (r, k, m, a) in enumerate(zip(requests, ks, max_ks, estimates))
                 if a >= LONG_PROBE_ACCEPTANCE and k < m and r.grammar is None]
        if not self.long_probe_every or not short:
            return ks
        self._plans_kept_short += 1
        if self._plans_kept_short < self.long_probe_every:
            return ks
        self._plans_kept_short = 0
        probe = list(ks)
        likeliest = max(short, key=lambda i: estimates[i])
        probe[likeliest] = max_ks[likeliest]
        return probe

    def _plan_by_depth(self, positions: Sequence[int], estimates: Sequence[float],
                       max_ks: Sequence[int], num_other_units: float,
                       padded_tokens: Callable[[int], int], free: Sequence[bool]) -> list[int]:
        """A padded step pads every sequence to its longest query, so its cost depends on the
        depth L (the most drafts any request gets), not on how many requests draft: one draft
        costs as much as L for everyone. Each depth is tried, every request drafting up to L
        tokens while a draft still gains >= 2% of a token (or, where some requests' drafts are
        free, only those drafting); the best tokens per second wins."""
        useful = [min(m, _useful_drafts(a)) for a, m in zip(estimates, max_ks)]

        shape, per_key = self.step_cost.row_shape, self.step_cost.row_key_units

        def units(ks: Sequence[int]) -> float:  # the padded rows, and the drafts' attention
            return (num_other_units + shape(padded_tokens(max(ks))) - shape(padded_tokens(0))
                    + per_key * sum(attended_keys(p + 1, k) for p, k in zip(positions, ks)))

        best_ks = [0] * len(estimates)
        best_rate = (1 + self.min_plan_gain) * len(estimates) / no_draft_seconds(
            self.no_draft, self.step_cost(num_other_units))
        groups = [[True] * len(free)] + ([list(free)] if any(free) and not all(free) else [])
        for depth in range(1, max(useful, default=0) + 1):
            for drafting in groups:
                ks = [min(depth, u) if d else 0 for u, d in zip(useful, drafting)]
                if not any(ks):
                    continue
                gain = sum(a * (1 - a ** k) / (1 - a) if a < 1 else float(k)
                           for a, k in zip(estimates, ks))
                drafted = [k for k, f in zip(ks, free) if not f]
                cost = (self.step_cost(units(ks)) + host_seconds(self.no_draft)
                        + self.draft_cost(sum(drafted), max(drafted, default=0)))
                rate = (len(estimates) + gain) / cost
                if rate > best_rate:
                    best_ks, best_rate = ks, rate
        return best_ks

    def _plan_greedy(self, positions: Sequence[int], estimates: Sequence[float],
                     max_ks: Sequence[int], num_other_units: float, num_other_rows: int,
                     free: Sequence[bool]) -> list[int]:
        """A flat step costs by the rows it feeds: drafts are lined up one at a time, the
        likeliest next draft first, and the step takes the first n of them for the n that gives
        the most expected tokens per second. Not the first that stops paying: a row's price
        follows the measured curve, so the 17th row of a 16-request step may not pay for itself
        where 16 drafts together do."""
        gains = float(len(estimates))  # each request emits at least one token
        no_draft = no_draft_seconds(self.no_draft, self.step_cost(num_other_units))
        best_rate, best_n = (1 + self.min_plan_gain) * gains / no_draft, 0
        overhead = host_seconds(self.no_draft)
        ks, order = [0] * len(estimates), []  # drafts so far, and whose each one is
        units, rows, drafted, longest = num_other_units, num_other_rows, 0, 0
        # Max-heap of (next draft's expected gain, request index).
        heap = [(-a, i) for i, a in enumerate(estimates) if max_ks[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain < MIN_DRAFT_GAIN:
                break
            ks[i] += 1
            order.append(i)
            if not free[i]:
                drafted, longest = drafted + 1, max(longest, ks[i])
            units += self.step_cost.draft_units(positions[i], ks[i], rows)
            rows += 1
            gains += gain
            rate = gains / (self.step_cost(units) + overhead + self.draft_cost(drafted, longest))
            if rate > best_rate:
                best_rate, best_n = rate, len(order)
            if ks[i] < max_ks[i]:
                heapq.heappush(heap, (-gain * estimates[i], i))
        best = [0] * len(estimates)
        for i in order[:best_n]:
            best[i] += 1
        return best

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.acceptance.observe(num_drafts, num_accepted)

    def observe_step(self, num_rows: int, row_keys: int, request_keys: int,
                     seconds: float) -> None:
        """A decode step: its rows (padding included), the keys they attended, and the keys
        of its requests' caches (step_cost.py)."""
        self.step_cost.observe(num_rows, seconds, row_keys, request_keys)

    def observe_drafting(self, num_draft_tokens: int, num_sequential_steps: int,
                         seconds: float) -> None:
        self.draft_cost.observe(num_draft_tokens, num_sequential_steps, seconds)


def _useful_drafts(acceptance: float) -> int:
    """Drafts whose expected gain (acceptance ** i for the i-th) is at least MIN_DRAFT_GAIN."""
    if acceptance >= 1.0:
        return 1 << 30
    return max(0, math.floor(math.log(MIN_DRAFT_GAIN) / math.log(max(acceptance, 1e-9))))
