"""The controller's step-cost fits: the start-up measurement, what online steps may change, and
the prefill chunks a plan leaves out (the plans themselves: test_controller.py)."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.controller import DraftCost, LinearCostModel, SpeculationController

MAX_K = 4


def make_controller(fixed, per_token) -> SpeculationController:
    return SpeculationController(MAX_K, True, LinearCostModel(fixed, per_token),
                                 DraftCost(per_step=False, seconds_per_unit=0.0))


class _TimedModel:
    """A stand-in forward that takes fixed + per_row * rows seconds, `slow_calls` of them 3x as
    long (a server starting beside others, a build running)."""

    def __init__(self, fixed: float, per_row: float, slow_calls: set[int]):
        self.fixed, self.per_row, self.slow_calls, self.calls = fixed, per_row, slow_calls, 0

    def __call__(self, ids, positions, kv_cache, meta, rows):
        import time

        import torch

        slow = 3.0 if self.calls in self.slow_calls else 1.0
        self.calls += 1
        time.sleep(slow * (self.fixed + self.per_row * ids.shape[0]))
        return torch.zeros(1)


def test_the_start_up_cost_fit_takes_the_fastest_timings():
    import torch

    from engine.spec_decode.factory import measure_step_cost

    class Blocks:
        num_blocks = 64

    fixed, per_row = 0.02, 0.002
    # one call of each row count slowed 3x: the fit still finds the line
    model = _TimedModel(fixed, per_row, slow_calls={1, 2, 3})
    cost = measure_step_cost(model, Blocks(), 16, torch.device("cpu"))
    assert cost.per_unit == pytest.approx(per_row, rel=0.25)
    assert cost.fixed == pytest.approx(fixed, rel=0.25)
    # negative control: where every call is slow, so is the fit
    slowed = measure_step_cost(_TimedModel(fixed, per_row, set(range(10))), Blocks(), 16,
                               torch.device("cpu"))
    assert slowed.per_unit > 2 * per_row


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap():
    """A chunk's work is paid once per prompt, whatever decoding does: the drafts planned beside
    one are those planned without it. Counted as decode rows (the negative control), a 256-token
    chunk made the step look so slow that drafts at 0.5 acceptance seemed to pay."""
    from engine.core.scheduler import ScheduledRequest, SchedulerOutput
    from engine.spec_decode.ngram import NgramProposer
    from engine.spec_decode.speculation import Speculation

    def planned(with_chunk: bool, chunk_as_decode: bool = False) -> list[int]:
        controller = make_controller(fixed=5e-3, per_token=1e-3)
        controller.max_k = MAX_K
        decoding = [ScheduledRequest(Request(f"d{i}", [1, 2, 1, 2, 1], SamplingParams()), 1,
                                     True, MAX_K) for i in range(16)]
        chunk = [ScheduledRequest(Request("p", list(range(300)), SamplingParams()), 256, False)]
        plan = SchedulerOutput(decoding + (chunk if with_chunk else []))
        if chunk_as_decode:  # what the planner was told before
            original = controller.plan
            controller.plan = lambda requests, ks, other, *rest: original(
                requests, ks, plan.num_batched_tokens, *rest)
        Speculation(NgramProposer(), controller).propose(plan, None)
        return [len(s.request.draft_token_ids) for s in decoding]

    alone = planned(with_chunk=False)
    assert planned(with_chunk=True) == alone
    assert sum(planned(with_chunk=True, chunk_as_decode=True)) > sum(alone)


def test_a_steady_batch_does_not_refit_the_slope_on_noise(monkeypatch):
    """16 requests feed 16 rows nearly every step, a probe now and then 17; steps vary by a
    few ms (a step's noise outweighs a row's cost). The slope stays where the start-up measured it and the intercept follows the steps;
    taking the least-squares slope of such data (the negative control) gives nonsense."""
    import random

    from engine.spec_decode import controller as module

    def fit(max_error: float) -> LinearCostModel:
        monkeypatch.setattr(module, "MAX_SLOPE_ERROR", max_error)
        rng = random.Random(2)
        cost = LinearCostModel(fixed=0.0055, per_unit=0.001)
        for step in range(400):
            rows = 17 if step % 32 == 31 else 16
            cost.observe(rows, 0.012 + 0.001 * rows + rng.uniform(-0.006, 0.006))
        return cost

    steady = fit(module.MAX_SLOPE_ERROR)
    assert steady.per_unit == 0.001
    assert steady(16) == pytest.approx(0.028, abs=0.001)
    noisy = fit(float("inf"))
    assert abs(noisy.per_unit - 0.001) > 0.0003  # 0.49 ms a row with this seed
