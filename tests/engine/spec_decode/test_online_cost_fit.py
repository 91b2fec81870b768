"""The step-cost model's online fit: what steady batches, growing contexts and a start-up
line timed on a busy CPU may change of a row's price (the start-up measurement itself:
test_cost_fit.py)."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.controller import SpeculationController
from engine.spec_decode.step_cost import DraftCost, LinearCostModel, attended_keys

MAX_K = 4


def test_a_steady_batch_does_not_refit_the_slope_on_noise(monkeypatch):
    """16 requests feed 16 rows nearly every step, a probe now and then 17; steps vary by a
    few ms (a step's noise outweighs a row's cost). The slope stays where the start-up measured it and the intercept follows the steps;
    taking the least-squares slope of such data (the negative control) gives nonsense."""
    import random

    from engine.spec_decode import step_cost as module

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


def test_growing_contexts_do_not_pull_the_row_price():
    """16 requests whose contexts grow from 100 to 600 keys, drafting now and then, with the
    start-up's cache-read price 2x too high: the two-variable fit keeps a row's price and
    learns the cache reads'. Negative control: fitted on units alone (the keys folded into
    the rows), the contexts' growth pins the row price at about half of what it is."""
    import random

    def fit(two_variables: bool) -> LinearCostModel:
        rng = random.Random(3)
        cost = LinearCostModel(fixed=0.005, per_unit=0.001, row_key_units=0.0005,
                               request_key_units=0.003)
        for step in range(500):
            context = 100 + step
            drafts = 4 if step % 8 == 7 else 0
            rows = 16 + drafts
            row_keys = 16 * (context + 1) + attended_keys(context, 1 + drafts) - (context + 1)
            request_keys = 16 * (context + 1) + drafts
            seconds = (0.005 + 0.001 * rows + 0.5e-6 * row_keys + 1.5e-6 * request_keys
                       + rng.uniform(-5e-4, 5e-4))
            if two_variables:
                cost.observe(rows, seconds, row_keys, request_keys)
            else:
                cost.observe(cost.units(rows, row_keys, request_keys), seconds)
        return cost

    fitted = fit(two_variables=True)
    assert fitted.per_unit == pytest.approx(0.001, rel=0.2)
    assert fitted.per_cache_key == pytest.approx(2e-6, rel=0.2)
    assert fit(two_variables=False).per_unit < 0.0008


def _steady_batch_fit(cost: LinearCostModel, fixed: float, per_row: float) -> LinearCostModel:
    """300 steps of 16 requests (a 17-row probe every 32nd) taking fixed + per_row x rows
    seconds, +-1 ms of noise: data that does not pin a slope."""
    import random

    rng = random.Random(4)
    for step in range(300):
        rows = 17 if step % 32 == 31 else 16
        cost.observe(rows, fixed + per_row * rows + rng.uniform(-0.001, 0.001))
    return cost


def test_steps_faster_than_the_start_up_line_scale_it_down(monkeypatch):
    """Four servers started together timed their start-up forwards on a shared CPU: one priced
    a row at 1.88 ms on a 9.3 ms step, where alone it was 0.57 on 3.6. Its steady 16-request
    steps then ran 3x faster than that line: the fit scales the line down to them, and 16
    requests whose drafts are nearly always accepted draft again. Negative control: moving
    only the intercept (the fit before) leaves it at 0 and the row at 1.88 ms, and nothing
    drafts."""
    fixed, per_row = 0.0036, 0.00057

    def plan(cost: LinearCostModel) -> list[int]:
        controller = SpeculationController(MAX_K, True, cost, DraftCost(per_step=False))
        requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(16)]
        for request in requests:
            request.num_computed_tokens = 2
            for _ in range(30):
                controller.observe_verification(request, 4, 4)
        assert requests[0].acceptance.estimate(controller.prior_acceptance) > 0.9
        return controller.plan(requests, [MAX_K] * 16, cost.units(16), num_other_rows=16)

    scaled = _steady_batch_fit(LinearCostModel(fixed=0.0093, per_unit=0.00188), fixed, per_row)
    assert scaled.per_unit == pytest.approx(per_row, rel=0.25)
    assert scaled(16) == pytest.approx(fixed + 16 * per_row, rel=0.1)
    assert sum(plan(scaled)) >= 16

    def intercept_only(self, sums):
        self.fixed = max((sums["t"] - self.per_unit * sums["r"]) / sums["w"], 0.0)

    monkeypatch.setattr(LinearCostModel, "_follow_held_line", intercept_only)
    stuck = _steady_batch_fit(LinearCostModel(fixed=0.0093, per_unit=0.00188), fixed, per_row)
    assert stuck.per_unit == 0.00188 and stuck.fixed == 0.0
    assert plan(stuck) == [0] * 16


def test_steps_slower_than_the_start_up_line_move_its_intercept_only():
    """Host work per step (scheduling, sampling) the start-up forward did not time makes steps
    slower than its line: a row keeps its measured price and the intercept takes the rest, it
    is not scaled up with them (the control of the scaling above)."""
    cost = _steady_batch_fit(LinearCostModel(fixed=0.0036, per_unit=0.00057), 0.0086, 0.00057)
    assert cost.per_unit == 0.00057
    assert cost.fixed == pytest.approx(0.0086, abs=0.0005)


def test_a_first_use_stall_does_not_price_the_steps(monkeypatch):
    """A GPU's first use of a verify shape compiles kernels: one step takes a second among
    1.5 ms ones. The fit sets it aside; taking it in (the negative control) reads as 10 ms of
    fixed cost 60 steps later. A run of slow steps is no stall: the line follows it."""
    from engine.spec_decode import step_cost as module

    def fit(outlier_factor: float) -> LinearCostModel:
        monkeypatch.setattr(module, "OUTLIER_FACTOR", outlier_factor)
        cost = LinearCostModel(fixed=0.0014, per_unit=0.0001)
        for step in range(60):
            rows = 1 + step % 5
            cost.observe(rows, 1.0 if step == 3 else 0.0014 + 0.0001 * rows)
        return cost

    assert fit(module.OUTLIER_FACTOR)(5) == pytest.approx(0.0019, rel=0.01)
    assert fit(float("inf"))(5) > 0.005
    slower = LinearCostModel(fixed=0.0014, per_unit=0.0001)
    for _ in range(40):  # the machine became 20x slower, for good
        slower.observe(1, 0.030)
    assert slower(1) == pytest.approx(0.030, rel=0.05)
