"""Tests of engine.spec_decode.controller (no model): the online cost fits and how many drafts the
adaptive controller hands out for given acceptance and cost. The counters and acceptance
trackers it reads are in test_spec_stats.py."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE
from engine.sampling_params import SamplingParams
from engine.spec_decode.controller import MIN_PLAN_GAIN, SpeculationController
from engine.spec_decode.step_cost import DraftCost, LinearCostModel, ModelDraftCost

MAX_K = 4


def make_request(request_id="r") -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams())


def make_controller(fixed, per_token, adaptive=True, draft_cost=None) -> SpeculationController:
    return SpeculationController(MAX_K, adaptive, LinearCostModel(fixed, per_token),
                                 draft_cost or DraftCost(per_step=False, seconds_per_unit=0.0))


def trained_request(controller, request_id, num_accepted=MAX_K, steps=30) -> Request:
    request = make_request(request_id)
    for _ in range(steps):
        controller.observe_verification(request, MAX_K, num_accepted)
    return request


# ------------------------------------------------------------------------------- cost models
def test_linear_cost_model_recovers_an_exact_line():
    model = LinearCostModel(fixed=0.05, per_unit=0.001)
    for n in [1, 8, 32, 1, 8, 32, 4]:
        model.observe(n, 0.02 + 0.003 * n)
    assert model.fixed == pytest.approx(0.02, abs=1e-9)
    assert model.per_unit == pytest.approx(0.003, abs=1e-9)
    assert model(10) == pytest.approx(0.05, abs=1e-9)


def test_linear_cost_model_without_spread_keeps_the_slope_and_moves_the_intercept():
    model = LinearCostModel(fixed=0.05, per_unit=0.01)
    for _ in range(5):
        model.observe(8, 1.0)
    assert model.per_unit == 0.01
    assert model.fixed == pytest.approx(1.0 - 0.08)


def test_linear_cost_model_forgets_old_measurements():
    model = LinearCostModel(fixed=0.0, per_unit=0.0)
    for n in [1, 16, 64] * 50:
        model.observe(n, 0.5 + 0.01 * n)
    for n in [1, 16, 64] * 200:
        model.observe(n, 0.1 + 0.002 * n)
    assert model.fixed == pytest.approx(0.1, rel=1e-3)
    assert model.per_unit == pytest.approx(0.002, rel=1e-3)


def test_draft_cost_counts_steps_or_tokens_and_averages_measurements():
    assert DraftCost(per_step=True, seconds_per_unit=0.1)(10, 3) == pytest.approx(0.3)
    assert DraftCost(per_step=False, seconds_per_unit=0.1)(10, 3) == pytest.approx(1.0)
    cost = DraftCost(per_step=True, seconds_per_unit=5.0)
    cost.observe(num_tokens=10, num_steps=0, seconds=1.0)  # nothing to divide by: ignored
    assert cost.seconds_per_unit == 5.0
    cost.observe(num_tokens=10, num_steps=2, seconds=0.4)  # the first one replaces the prior
    assert cost.seconds_per_unit == pytest.approx(0.2)
    cost.observe(num_tokens=10, num_steps=2, seconds=0.8)
    assert cost.seconds_per_unit == pytest.approx(0.9 * 0.2 + 0.1 * 0.4)


# ------------------------------------------------------------------------------- controller
def test_non_adaptive_controller_returns_the_maximum():
    controller = make_controller(fixed=0.01, per_token=1.0, adaptive=False)
    requests = [make_request(str(i)) for i in range(3)]
    assert controller.plan(requests, [4, 0, 2], num_other_units=3) == [4, 0, 2]
    assert controller.lookahead(requests[0]) == MAX_K


def test_cheap_verification_and_high_acceptance_speculate_up_to_the_maximum():
    controller = make_controller(fixed=1.0, per_token=0.001)
    requests = [trained_request(controller, str(i)) for i in range(3)]
    assert controller.plan(requests, [4, 2, 0], num_other_units=3) == [4, 2, 0]
    fresh = [make_request("a"), make_request("b")]  # at the prior: still worth it
    assert controller.plan(fresh, [4, 4], num_other_units=2) == [4, 4]


def test_expensive_sequential_drafting_limits_the_draft_length():
    # Each draft-model step costs 30% of a target step; the second draft (expected 0.36 tokens)
    # no longer pays for it, the first (0.6) does.
    controller = make_controller(fixed=1.0, per_token=0.001,
                                 draft_cost=DraftCost(per_step=True, seconds_per_unit=0.3))
    assert controller.plan([make_request()], [4], num_other_units=1) == [1]


def test_free_drafts_are_priced_by_their_verification_alone():
    """Drafting that costs a whole target step would stop every draft; a request whose drafts
    are free this step (an EAGLE request proposing a copy) still gets them, the other not."""
    expensive = ModelDraftCost(1.0, LinearCostModel(1.0, 0.001))
    for padded in (None, lambda depth: 2 + 2 * depth):
        controller = make_controller(fixed=1.0, per_token=0.001, draft_cost=expensive)
        copying, drafting = make_request("copy"), make_request("head")
        plan = controller.plan([copying, drafting], [MAX_K, MAX_K], 2, padded,
                               free=[True, False])
        assert plan[0] > 0 and plan[1] == 0
        # The control: priced as model drafts, neither pays.
        assert controller.plan([copying, drafting], [MAX_K, MAX_K], 2, padded) == [0, 0]


def test_always_rejected_request_stops_speculating_beside_an_always_accepted_one():
    controller = make_controller(fixed=1.0, per_token=0.15)
    good, bad = make_request("good"), make_request("bad")
    good_ks, bad_ks, bad_estimates = [], [], []
    for step in range(120):
        k_good, k_bad = controller.plan([good, bad], [MAX_K, MAX_K], num_other_units=2)
        if k_good:
            controller.observe_verification(good, k_good, k_good)
        if k_bad:
            controller.observe_verification(bad, k_bad, 0)
        if step >= 20:  # after a warm-up
            good_ks.append(k_good)
            bad_ks.append(k_bad)
            bad_estimates.append(bad.acceptance.estimate(controller.prior_acceptance))
    assert sum(k > 0 for k in bad_ks) < 0.2 * len(bad_ks)  # rare probes only
    assert sum(bad_ks) < 0.2 * len(bad_ks)
    assert max(bad_estimates) < 0.5 and sum(bad_estimates) / len(bad_estimates) < 0.45
    assert good_ks == [MAX_K] * len(good_ks)
    assert good.acceptance.estimate() > 0.9


def test_expensive_per_token_verification_switches_speculation_off():
    # A large batch: 64 tokens at 0.01 s each on top of 0.1 s make about 86 tokens per second,
    # while a draft accepted 3 times in 4 returns 0.74 tokens per 0.01 s, 74 per second.
    controller = make_controller(fixed=0.1, per_token=0.01)
    requests = [trained_request(controller, str(i), num_accepted=3) for i in range(64)]
    assert requests[0].acceptance.estimate() == pytest.approx(0.74, abs=0.01)
    assert controller.plan(requests, [MAX_K] * 64, num_other_units=64) == [0] * 64
    # The same costs and acceptance with one request alone: the fixed cost dominates.
    assert controller.plan(requests[:1], [MAX_K], num_other_units=1) == [MAX_K]


def test_requests_not_speculating_drift_back_towards_the_prior():
    controller = make_controller(fixed=0.01, per_token=0.01)
    requests = [trained_request(controller, str(i), num_accepted=0) for i in range(64)]
    before = requests[0].acceptance.estimate()
    for _ in range(10):
        assert controller.plan(requests, [MAX_K] * 64, num_other_units=64) == [0] * 64
    after = requests[0].acceptance.estimate()
    assert before < after < PRIOR_ACCEPTANCE


def test_model_drafting_is_priced_by_the_rows_it_runs():
    """A draft model's step over b sequences costs like a target step of b tokens, times its
    fraction: in a large batch that makes drafting expensive, where a flat per-step price made
    it look free."""
    step_cost = LinearCostModel(fixed=0.010, per_unit=0.002)
    flat = DraftCost(per_step=True, seconds_per_unit=0.5 * step_cost(1))
    by_rows = ModelDraftCost(0.5, step_cost)
    assert by_rows(1, 1) == pytest.approx(flat(1, 1))  # one sequence: the same price
    assert by_rows(32, 1) == pytest.approx(0.5 * (0.010 + 0.064))
    assert by_rows(3 * 32, 3) > 2 * flat(3 * 32, 3)  # three draft steps over 32 sequences
    # The fraction follows what proposals really cost.
    for _ in range(100):
        by_rows.observe(num_tokens=32, num_steps=1, seconds=0.25 * (0.010 + 0.064))
    assert by_rows.fraction == pytest.approx(0.25, rel=0.01)


def _padded(num_seqs):
    """Rows of a padded step (bucketed batch x query length a power of two, at most 1 + MAX_K)."""
    from engine.runner.static_runner import BATCH_BUCKETS, bucket_for, power_of_two_bucket

    return lambda depth: bucket_for(num_seqs, BATCH_BUCKETS) * power_of_two_bucket(1 + depth,
                                                                                   1 + MAX_K)


def test_padded_steps_price_a_draft_as_padding_every_sequence():
    """One request drafting pads all 16 to two rows each. Flat pricing charges one token and
    drafts for the sure request; padded pricing sees 16 extra rows for ~1.3 expected tokens."""
    controller = make_controller(fixed=0.010, per_token=0.001)
    sure = trained_request(controller, "sure", num_accepted=MAX_K)
    rest = [trained_request(controller, str(i), num_accepted=0) for i in range(15)]
    requests = [sure, *rest]
    flat = controller.plan(requests, [MAX_K] * 16, num_other_units=16)
    assert flat[0] == MAX_K and not any(flat[1:])
    assert controller.plan(requests, [MAX_K] * 16, 16, padded_tokens=_padded(16)) == [0] * 16


def test_padded_steps_fill_the_rows_that_are_padded_anyway():
    """Once the rows are paid for, every request drafts to the same depth: where greedy
    one-at-a-time pricing stops at the first draft that does not pay alone, depth pricing
    weighs all 16 requests' drafts against the one step they share."""
    controller = make_controller(fixed=0.010, per_token=0.0005)
    requests = [trained_request(controller, str(i), num_accepted=2) for i in range(16)]
    estimate = requests[0].acceptance.estimate()
    assert 0.6 < estimate < 0.7
    ks = controller.plan(requests, [MAX_K] * 16, 16, padded_tokens=_padded(16))
    assert len(set(ks)) == 1 and ks[0] >= 1
    # The chosen depth is the best of all depths.
    def rate(depth):
        gain = 16 * sum(estimate ** j for j in range(1, depth + 1))
        return (16 + gain) / controller.step_cost(_padded(16)(depth))
    assert rate(ks[0]) == max(rate(d) for d in range(MAX_K + 1))
    # Expensive rows (a CPU): no depth pays.
    costly = make_controller(fixed=0.028, per_token=0.009)
    assert costly.plan(requests, [MAX_K] * 16, 16, padded_tokens=_padded(16)) == [0] * 16


def test_a_plan_must_promise_more_than_the_pricing_error():
    """16 requests at 0.9 acceptance on a step where a verified row costs what a decoded one
    does (CPU, 16 concurrent): one draft each promises ~3% more tokens per second, within what
    a fitted row price is off by, so nothing drafts. Control: without the margin they draft;
    and where rows are cheap they draft with it."""
    def plan(per_token: float, min_gain: float = MIN_PLAN_GAIN) -> list[int]:
        controller = make_controller(fixed=2.94 * per_token, per_token=per_token)
        controller.min_plan_gain = min_gain
        requests = [trained_request(controller, str(i), num_accepted=MAX_K - 1)
                    for i in range(16)]
        for request in requests:
            for _ in range(30):
                controller.observe_verification(request, 10, 9)
        assert 0.85 < requests[0].acceptance.estimate() < 0.95
        return controller.plan(requests, [MAX_K] * 16, num_other_units=16)

    rows_like_tokens = 0.0009  # a step of 16 rows: 17 ms, a row past them 0.9 ms
    assert plan(rows_like_tokens) == [0] * 16
    assert sum(plan(rows_like_tokens, min_gain=0.0)) >= 16
    cheap = make_controller(fixed=0.010, per_token=0.0003)  # the promise: ~30%
    requests = [trained_request(cheap, str(i), num_accepted=MAX_K - 1) for i in range(16)]
    assert sum(cheap.plan(requests, [MAX_K] * 16, num_other_units=16)) >= 16


def _long_probes(every: int, drafts_accepted=(12, 11)) -> list[int]:
    """32 plans for one request whose drafts are accepted ~92% of the time (or less), where a
    row costs as much as a step's fixed part: the best plan is 3-4 drafts of its 15."""
    controller = SpeculationController(15, True, LinearCostModel(1.0, 1.0),
                                       DraftCost(per_step=False, seconds_per_unit=0.0))
    controller.long_probe_every = every
    request = make_request()
    for _ in range(30):
        controller.observe_verification(request, *drafts_accepted)
    return [controller.plan([request], [15], num_other_units=1)[0] for _ in range(32)]


def test_a_likely_request_kept_short_gets_its_ceiling_now_and_then():
    """Every 16th plan that keeps a request likely to accept (>= 0.9) short of its ceiling gives
    it the ceiling, so a step-cost fit that prices rows too dear sees a long step again.
    Controls: never with the probes off, never for a request accepted less often."""
    planned = _long_probes(16)
    assert [i for i, k in enumerate(planned) if k == 15] == [15, 31]
    assert all(2 <= k <= 5 for i, k in enumerate(planned) if i not in (15, 31))
    assert 15 not in _long_probes(0)
    assert 15 not in _long_probes(16, drafts_accepted=(12, 5))
