"""The price of drafting nothing where the engine then runs quiet steps (step_periods.py): measured
from step periods, and what it changes in the controller's plans (issue 71: `ngram` drafting on
code, where its drafts are accepted 11-15% of the time, lost to `none` on a GPU)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.spec_decode.step_periods import (MIN_OBSERVATIONS, NoDraftPrice, StepPeriods,
                                             batch_bucket)
from tests.conftest import make_llm
from tests.engine.spec_decode.test_controller import (MAX_K, make_controller, make_request,
                                                      trained_request)
from tests.engine.test_overlap import PROMPTS, _summary


def _quiet_run(periods: StepPeriods, now: float, steps: int, period: float, landing: float,
               batch: int = 1) -> float:
    """Steps: `steps` overlapped launches `period` apart, then the call that lands the last."""
    for _ in range(steps):
        periods.start(now)
        periods.mark_quiet(batch)
        now += period
    periods.start(now)
    periods.mark_landing()
    return now + landing


def _sync_step(periods: StepPeriods, now: float, seconds: float, priced: float,
               batch: int = 1) -> float:
    periods.start(now)
    periods.mark_sync(batch, priced)
    return now + seconds


def test_a_quiet_step_costs_its_run_with_the_landing_and_a_synchronous_one_its_host_time():
    periods, now = StepPeriods(), 0.0
    for _ in range(MIN_OBSERVATIONS):
        assert periods.no_draft_price(1) is None  # unmeasured: the controller prices as before
        now = _sync_step(periods, now, seconds=0.00197, priced=0.00150)
        now = _quiet_run(periods, now, steps=4, period=0.00154, landing=0.0005)
    now = _sync_step(periods, now, seconds=0.00197, priced=0.00150)
    periods.start(now)  # attributes the last step
    price = periods.no_draft_price(1)
    assert price.quiet_seconds == pytest.approx((4 * 0.00154 + 0.0005) / 4)
    assert price.sync_overhead == pytest.approx(0.00047)
    # other batch sizes are priced on their own; 9 to 16 requests share a price
    assert periods.no_draft_price(16) is None
    assert [batch_bucket(n) for n in (1, 2, 3, 9, 16, 17)] == [1, 2, 4, 16, 16, 32]


def test_steps_of_other_kinds_teach_nothing():
    """A prefill step (no mark) between runs is no part of either price."""
    periods, now = StepPeriods(), 0.0
    for _ in range(MIN_OBSERVATIONS + 1):
        now = _sync_step(periods, now, seconds=0.002, priced=0.0015)
        periods.start(now)  # a prefill step, 50 ms
        now += 0.050
        now = _quiet_run(periods, now, steps=2, period=0.001, landing=0.0)
    periods.start(now)
    price = periods.no_draft_price(1)
    assert price.quiet_seconds == pytest.approx(0.001)
    assert price.sync_overhead == pytest.approx(0.0005)


def _code_like(controller):
    """A request whose drafts are accepted ~15% of the time (`ngram` on code)."""
    request = make_request("code")
    for i in range(40):
        controller.observe_verification(request, 1, 1 if i % 7 == 0 else 0)
    return request


def test_drafts_that_do_not_beat_a_quiet_step_are_not_planned():
    # a device where verifying a few more rows costs next to nothing (an H200: 8 rows cost
    # 1.00x one row)
    controller = make_controller(fixed=0.00150, per_token=0.000001)
    requests = [_code_like(controller)]
    assert 0.1 < requests[0].acceptance.estimate() < 0.25
    # The control: priced as synchronous steps alone, a cheap row makes the draft look worth it.
    assert sum(controller.plan(requests, [MAX_K], num_other_units=1)) > 0
    # With the measured prices (an H100: quiet 1.54 ms, a synchronous step's host 0.47 ms on
    # top of its 1.5 ms forward) no draft is the faster plan.
    controller.no_draft = NoDraftPrice(quiet_seconds=0.00154, sync_overhead=0.00047)
    assert controller.plan(requests, [MAX_K], num_other_units=1) == [0]
    # Drafts that are nearly always accepted still go out (copying).
    sure = trained_request(controller, "copy", num_accepted=MAX_K)
    assert controller.plan([sure], [MAX_K], num_other_units=1)[0] == MAX_K


def test_an_engine_with_quiet_steps_measures_their_price_and_keeps_nones_tokens(
        tiny_chat_model_folder):
    """On a CPU, with --async-scheduling named: both kinds of step are measured at batch 1, and
    the outputs stay `none`'s."""
    folder = str(tiny_chat_model_folder)
    plain = make_llm(folder, enforce_eager=True, speculative_method="none", async_scheduling=False)
    quiet = make_llm(folder, enforce_eager=True, speculative_method="ngram", async_scheduling=True)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        assert _summary(quiet.generate([prompt], params)) == _summary(plain.generate([prompt],
                                                                                      params))
    price = quiet.engine.speculation.periods.no_draft_price(1)
    assert price is not None and price.quiet_seconds > 0 and price.sync_overhead >= 0
    # the control: without quiet steps nothing is measured
    sync = make_llm(folder, enforce_eager=True, speculative_method="ngram", async_scheduling=False)
    sync.generate(PROMPTS[:1], params)
    assert sync.engine.speculation.periods.no_draft_price(1) is None


def test_a_step_priced_at_nothing_plans_without_dividing_by_zero():
    """A fitted line with no fixed part prices a step with no decode rows (every request feeding
    its prompt's last chunk) at 0 seconds; the plan divided by it and the engine died. Now such
    a step is priced at MIN_STEP_SECONDS: no draft then looks cheapest, and the plan is valid."""
    controller = make_controller(fixed=0.0, per_token=0.001)
    sure = trained_request(controller, "copy", num_accepted=MAX_K)
    assert controller.plan([sure], [MAX_K], num_other_units=0) == [0]
    priced = make_controller(fixed=0.001, per_token=0.0001)  # the control: a step with a price
    assert priced.plan([trained_request(priced, "copy")], [MAX_K], num_other_units=0)[0] == MAX_K
    free = make_controller(fixed=0.0, per_token=0.0)  # nothing costs anything: drafts are free
    assert free.plan([trained_request(free, "x")], [MAX_K], num_other_units=0)[0] == MAX_K
