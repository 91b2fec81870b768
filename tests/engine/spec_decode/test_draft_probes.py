"""The controller's probes: one draft now and then where none is planned, so the step-cost fit
sees a verified token's price again (PROBE_EVERY), spaced further where drafting one token runs
a model (PROBE_DRAFT_BUDGET)."""

from __future__ import annotations

from engine.spec_decode.step_cost import DraftCost
from tests.engine.spec_decode.test_controller import MAX_K, make_controller, trained_request


def _drafting_after_a_bad_slope(probe_every: int) -> list[int]:
    """Batch 1 with drafts accepted 3 times in 4: the fit first sees two noisy steps that make a
    verified token cost 4 ms on a 4.5 ms step, where a draft does not pay, then the true cost,
    4 ms + 0.5 ms a token, where four do. The draft counts planned over 300 more steps."""
    controller = make_controller(fixed=0.004, per_token=0.0005)
    controller.probe_every = probe_every
    for n, seconds in [(1, 0.0045), (2, 0.0085), (1, 0.0045), (2, 0.0085)]:
        controller.observe_step(n, 0, 0, seconds)
    request = trained_request(controller, "r", num_accepted=3)
    planned = []
    for _ in range(300):
        (k,) = controller.plan([request], [MAX_K], num_other_units=1)
        controller.observe_step(1 + k, 0, 0, 0.004 + 0.0005 * (1 + k))
        if k:
            controller.observe_verification(request, k, min(k, 3))
        planned.append(k)
    return planned


def test_a_slope_overestimated_once_is_corrected_by_probes():
    """With drafting off every step feeds one token, so without probes nothing ever corrects
    the fit (the negative control); with them drafting comes back within a few probes."""
    assert _drafting_after_a_bad_slope(probe_every=0) == [0] * 300
    planned = _drafting_after_a_bad_slope(probe_every=32)
    assert planned[:31] == [0] * 31  # the bad fit holds until the first probe
    assert planned[31] == 1
    assert all(k >= 2 for k in planned[200:])  # drafting is back, and stays


def _probe_steps(draft_seconds: float) -> list[int]:
    """Plans (from 0) that drafted, over 400, for a lone request whose drafts never pay (rows as
    dear as the 4 ms step), where drafting one token costs `draft_seconds`."""
    controller = make_controller(fixed=0.004, per_token=0.004, draft_cost=DraftCost(
        per_step=True, seconds_per_unit=draft_seconds))
    request = trained_request(controller, "r", num_accepted=0)
    drafted = []
    for step in range(400):
        (k,) = controller.plan([request], [MAX_K], num_other_units=1)
        if k:
            controller.observe_verification(request, k, 0)
            drafted.append(step)
    return drafted


def test_probes_with_a_dear_draft_are_spaced_by_its_cost():
    """A model's draft for a probe costs most of a step (`layer-skip`): its probes come as often
    as keep their drafting within PROBE_DRAFT_BUDGET of the steps' time, every 90 plans for a
    draft of 90% of a step. Control: a free draft (a lookup) probes every PROBE_EVERY plans."""
    from engine.spec_decode.controller import PROBE_DRAFT_BUDGET, PROBE_EVERY

    free = _probe_steps(0.0)
    assert free[:3] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    dear = _probe_steps(0.9 * 0.008)  # the step with its one row: 8 ms
    spacing = round(0.9 / PROBE_DRAFT_BUDGET)
    assert dear[:3] == [spacing - 1, 2 * spacing - 1, 3 * spacing - 1]
