"""How many tokens to speculate: per request from its recent acceptance, per step from cost.

Model. A request whose drafts are accepted with probability a each gains a^i expected tokens from
its i-th draft. A step that feeds n tokens costs about t(n) = fixed + per_token * n (fitted online
from measured steps), and drafting costs time per token (n-gram lookup) or per sequential draft
step (a draft model). The controller starts every request at K = 0 and hands out draft tokens one
at a time, always to the request whose next draft is likeliest to be accepted, while doing so raises the
step's expected tokens per second. So speculation switches itself off for requests whose drafts
keep failing, and for batches so large that verifying costs more than it returns.

A request's acceptance is tracked with decayed counts that drift back towards a prior when it is
not speculating, so a request that was switched off probes again now and then.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from engine.core.request import Request
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE

COST_DECAY = 0.98  # per observation for the step-time fit
# How precisely the online data must pin the slope (its standard error, as a share of the slope)
# before the fit takes it; less precise, the fit keeps its slope and moves only its intercept. At
# a steady 16 requests nearly every step feeds 16 rows, and a slope fitted on them and a rare
# 17-row probe was noise, once 1.7 ms a row with no fixed part, and then no draft paid. At batch 1
# the same probes against 1-row steps pin it well (steps vary far less than a row's cost).
MAX_SLOPE_ERROR = 0.25
MIN_DRAFT_GAIN = 0.02  # expected tokens below which a draft position is not even reserved
# Steps without a draft after which one draft goes out anyway. The cost fit learns a verified
# token's price only from steps that feed more tokens than they have requests; with drafting off
# every step feeds one per request, so a slope overestimated once (a noisy step) would keep
# drafting off for good. A probe every 32 steps costs < 1% of a step's rows at batch 1.
PROBE_EVERY = 32


class LinearCostModel:
    """t(n) = fixed + per_unit * n, fitted by exponentially forgetting least squares."""

    def __init__(self, fixed: float, per_unit: float):
        self.fixed, self.per_unit = fixed, per_unit
        self._sums = [0.0] * 6  # weight, n, t, n*n, n*t, t*t

    def observe(self, n: float, seconds: float) -> None:
        w, sn, st, snn, snt, stt = (v * COST_DECAY for v in self._sums)
        self._sums = [w + 1, sn + n, st + seconds, snn + n * n, snt + n * seconds,
                      stt + seconds * seconds]
        per_unit = self._precise_slope()
        w, sn, st = self._sums[:3]
        if per_unit is not None:
            fixed = (st - per_unit * sn) / w
            if fixed >= 0:
                self.fixed, self.per_unit = fixed, per_unit
                return
        # The data does not pin a slope yet: keep the slope, move the intercept to the data.
        self.fixed = max(st / w - self.per_unit * sn / w, 0.0)

    def _precise_slope(self) -> float | None:
        """The least-squares slope, where its standard error is within MAX_SLOPE_ERROR of it."""
        w, sn, st, snn, snt, stt = self._sums
        if w < 3:
            return None
        sxx, sxy, syy = snn - sn * sn / w, snt - sn * st / w, stt - st * st / w
        if sxx <= 1e-9 * max(snn, 1.0):
            return None
        slope = sxy / sxx
        residual = max(syy - slope * sxy, 0.0) / max(w - 2, 1e-9)
        if slope < 0 or (residual / sxx) ** 0.5 > MAX_SLOPE_ERROR * slope:
            return None
        return slope

    def __call__(self, n: float) -> float:
        return self.fixed + self.per_unit * n


class DraftCost:
    """Seconds of drafting. A model-based proposer pays per sequential draft step (one forward
    of the draft per position, whatever the batch); n-gram lookup pays per token."""

    def __init__(self, per_step: bool, seconds_per_unit: float = 0.0):
        self.per_step = per_step
        self.seconds_per_unit = seconds_per_unit
        self._observed = False

    def __call__(self, num_tokens: int, num_steps: int) -> float:
        return self.seconds_per_unit * (num_steps if self.per_step else num_tokens)

    def observe(self, num_tokens: int, num_steps: int, seconds: float) -> None:
        units = num_steps if self.per_step else num_tokens
        if units:
            rate = seconds / units
            self.seconds_per_unit = rate if not self._observed else (
                0.9 * self.seconds_per_unit + 0.1 * rate)
            self._observed = True


class ModelDraftCost:
    """Seconds of drafting with a model (a draft model, the target's own layers, an EAGLE head):
    a `fraction` of what the target's fitted step cost charges for the same rows. A draft step
    over b sequences costs like a small target step of b tokens, so drafting for a batch costs
    fraction * (fixed * steps + per_token * draft tokens), where a flat per-step price would
    undercharge every draft after a step's first. The fraction is re-estimated from every
    measured proposal."""

    per_step = True

    def __init__(self, fraction: float, step_cost: LinearCostModel):
        self.fraction = fraction
        self.step_cost = step_cost

    def _target_seconds(self, num_tokens: int, num_steps: int) -> float:
        return self.step_cost.fixed * num_steps + self.step_cost.per_unit * num_tokens

    def __call__(self, num_tokens: int, num_steps: int) -> float:
        return self.fraction * self._target_seconds(num_tokens, num_steps)

    def observe(self, num_tokens: int, num_steps: int, seconds: float) -> None:
        reference = self._target_seconds(num_tokens, num_steps)
        if num_steps and reference > 0:
            self.fraction = 0.9 * self.fraction + 0.1 * seconds / reference


class SpeculationController:
    def __init__(self, max_k: int, adaptive: bool, step_cost: LinearCostModel,
                 draft_cost: DraftCost | ModelDraftCost, prior_acceptance: float = PRIOR_ACCEPTANCE):
        self.max_k = max_k
        self.prior_acceptance = prior_acceptance
        self.adaptive = adaptive
        self.step_cost = step_cost  # seconds for a target step of n tokens
        self.draft_cost = draft_cost
        self.probe_every = PROBE_EVERY  # 0: never probe
        self._plans_without_drafts = 0

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
             num_other_tokens: int,
             padded_tokens: Callable[[int], int] | None = None,
             free: Sequence[bool] | None = None) -> list[int]:
        """Draft tokens per request for this step. `num_other_tokens`: decode rows fed anyway
        (each request's last token). Other requests' prefill chunks in the same step are left
        out: their work is paid once per prompt however many steps decoding takes, so it is no
        part of what a draft saves (a step's fixed cost is, per step); counted as decode rows,
        a chunk made the step look so slow that any draft seemed to pay, and 16 concurrent
        agent loops, re-sending their histories, ran at 0.86x `none`. `padded_tokens`, for a step
        that will run padded (static_runner.py): the rows it computes when its longest request
        drafts L tokens. `free[i]`: request i's drafts cost no drafting this step (an EAGLE
        request proposing a copy), only their verified rows."""
        if not self.adaptive:
            return list(max_ks)
        estimates = [r.acceptance.estimate(self.prior_acceptance) for r in requests]
        free = list(free) if free is not None else [False] * len(requests)
        if padded_tokens is not None:
            ks = self._plan_by_depth(estimates, max_ks, padded_tokens, free)
        else:
            ks = self._plan_greedy(estimates, max_ks, num_other_tokens, free)
        ks = self._probe_now_and_then(ks, estimates, max_ks)
        for request, k in zip(requests, ks):
            if k == 0:
                request.acceptance.decay()  # drift back towards the prior, to probe later
        return ks

    def _probe_now_and_then(self, ks: list[int], estimates: Sequence[float],
                            max_ks: Sequence[int]) -> list[int]:
        """After `probe_every` plans without a draft, one draft for the likeliest request, so
        the step-cost fit sees a verified token's price again (see PROBE_EVERY)."""
        if any(ks):
            self._plans_without_drafts = 0
            return ks
        self._plans_without_drafts += 1
        candidates = [i for i, m in enumerate(max_ks) if m > 0]
        if not self.probe_every or self._plans_without_drafts < self.probe_every \
                or not candidates:
            return ks
        self._plans_without_drafts = 0
        probe = list(ks)
        probe[max(candidates, key=lambda i: estimates[i])] = 1
        return probe

    def _plan_by_depth(self, estimates: Sequence[float], max_ks: Sequence[int],
                       padded_tokens: Callable[[int], int], free: Sequence[bool]) -> list[int]:
        """A padded step pads every sequence to its longest query, so its cost depends on the
        depth L (the most drafts any request gets), not on how many requests draft: one draft
        costs as much as L for everyone. Each depth is tried, every request drafting up to L
        tokens while a draft still gains >= 2% of a token (or, where some requests' drafts are
        free, only those drafting); the best tokens per second wins."""
        useful = [min(m, _useful_drafts(a)) for a, m in zip(estimates, max_ks)]
        best_ks = [0] * len(estimates)
        best_rate = len(estimates) / self.step_cost(padded_tokens(0))
        groups = [[True] * len(free)] + ([list(free)] if any(free) and not all(free) else [])
        for depth in range(1, max(useful, default=0) + 1):
            for drafting in groups:
                ks = [min(depth, u) if d else 0 for u, d in zip(useful, drafting)]
                if not any(ks):
                    continue
                gain = sum(a * (1 - a ** k) / (1 - a) if a < 1 else float(k)
                           for a, k in zip(estimates, ks))
                drafted = [k for k, f in zip(ks, free) if not f]
                cost = (self.step_cost(padded_tokens(max(ks)))
                        + self.draft_cost(sum(drafted), max(drafted, default=0)))
                rate = (len(estimates) + gain) / cost
                if rate > best_rate:
                    best_ks, best_rate = ks, rate
        return best_ks

    def _plan_greedy(self, estimates: Sequence[float], max_ks: Sequence[int],
                     num_other_tokens: int, free: Sequence[bool]) -> list[int]:
        """A flat step costs by the tokens it feeds: drafts go out one at a time, to the
        likeliest next draft, while each raises the step's expected tokens per second."""
        ks = [0] * len(estimates)
        gains = float(len(estimates))  # each request emits at least one token
        cost = self.step_cost(num_other_tokens)
        total_drafts, drafted, longest = 0, 0, 0  # all drafts; those drafting costs, and depth
        # Max-heap of (next draft's expected gain, request index).
        heap = [(-a, i) for i, a in enumerate(estimates) if max_ks[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            new_longest = longest if free[i] else max(longest, ks[i] + 1)
            new_drafted = drafted + (0 if free[i] else 1)
            new_cost = (self.step_cost(num_other_tokens + total_drafts + 1)
                        + self.draft_cost(new_drafted, new_longest))
            if (gains + gain) / new_cost <= gains / cost:
                break  # the likeliest remaining draft no longer pays for itself
            ks[i] += 1
            gains += gain
            cost = new_cost
            total_drafts += 1
            drafted, longest = new_drafted, new_longest
            if ks[i] < max_ks[i]:
                heapq.heappush(heap, (-gain * estimates[i], i))
        return ks

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.acceptance.observe(num_drafts, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_cost.observe(num_tokens, seconds)

    def observe_drafting(self, num_draft_tokens: int, num_sequential_steps: int,
                         seconds: float) -> None:
        self.draft_cost.observe(num_draft_tokens, num_sequential_steps, seconds)


def _useful_drafts(acceptance: float) -> int:
    """Drafts whose expected gain (acceptance ** i for the i-th) is at least MIN_DRAFT_GAIN."""
    if acceptance >= 1.0:
        return 1 << 30
    return max(0, math.floor(math.log(MIN_DRAFT_GAIN) / math.log(max(acceptance, 1e-9))))
