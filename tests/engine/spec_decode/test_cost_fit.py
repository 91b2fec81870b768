"""The controller's step-cost fits: the start-up measurement, the prices it gives rows and keys,
and the prefill chunks a plan leaves out (the online fit: test_online_cost_fit.py; the plans
themselves: test_controller.py)."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.controller import SpeculationController
from engine.spec_decode.step_cost import DraftCost, LinearCostModel

MAX_K = 4


def make_controller(fixed, per_token) -> SpeculationController:
    return SpeculationController(MAX_K, True, LinearCostModel(fixed, per_token),
                                 DraftCost(per_step=False, seconds_per_unit=0.0))


class _TimedModel:
    """A stand-in forward that takes fixed + per_row * rows seconds, plus per_row_key for each
    key a row attends and per_request_key for each key of the request's cache, `slow_calls` of
    them 3x as long (a server starting beside others, a build running)."""

    class arch:
        max_position_embeddings = 4096

    def __init__(self, fixed: float, per_row: float, slow_calls: set[int],
                 per_row_key: float = 0.0, per_request_key: float = 0.0,
                 past_16: float = 0.0):
        self.fixed, self.per_row, self.slow_calls, self.calls = fixed, per_row, slow_calls, 0
        self.per_row_key, self.per_request_key = per_row_key, per_request_key
        self.past_16 = past_16  # a kernel's second chunk of rows: once, from the 17th row

    def __call__(self, ids, positions, kv_cache, meta, rows):
        import time

        import torch

        slow = 3.0 if self.calls in self.slow_calls else 1.0
        self.calls += 1
        keys = int((positions + 1).sum())
        time.sleep(slow * (self.fixed + self.per_row * ids.shape[0] + self.per_row_key * keys
                           + self.per_request_key * (int(positions.max()) + 1)
                           + (self.past_16 if ids.shape[0] > 16 else 0.0)))
        return torch.zeros(1)


class _Blocks:
    """The KV cache as the probe sees it: a number of blocks, and pages it hands back."""
    num_blocks = 64

    def release_pages(self) -> None:
        pass


def test_the_start_up_cost_fit_takes_the_fastest_timings():
    import torch

    from engine.spec_decode.cost_probe import measure_step_cost

    fixed, per_row = 0.02, 0.002
    # one call of each row count slowed 3x: the fit still finds the line
    model = _TimedModel(fixed, per_row, slow_calls={1, 2, 3})
    cost = measure_step_cost(model, _Blocks(), 16, torch.device("cpu"))
    assert cost.per_unit == pytest.approx(per_row, rel=0.25)
    assert cost.fixed == pytest.approx(fixed, rel=0.25)
    # negative control: where every call is slow, so is the fit
    slowed = measure_step_cost(_TimedModel(fixed, per_row, set(range(100))), _Blocks(), 16,
                               torch.device("cpu"))
    assert slowed.per_unit > 2 * per_row


def test_the_start_up_fit_prices_attended_keys_and_cache_reads():
    """A row's attention and a request's cache read are priced apart: a draft row at 512 keys
    costs its row plus its attention, not the cache read its request pays anyway. The control:
    a forward whose time does not depend on keys gets no key price."""
    import torch

    from engine.spec_decode.cost_probe import measure_step_cost

    per_row, per_row_key, per_request_key = 0.001, 1e-6, 2e-6
    cost = measure_step_cost(_TimedModel(0.004, per_row, set(), per_row_key, per_request_key),
                             _Blocks(), 16, torch.device("cpu"))
    assert cost.per_unit * cost.row_key_units == pytest.approx(per_row_key, rel=0.3)
    assert cost.per_cache_key == pytest.approx(per_row_key + per_request_key, rel=0.3)
    assert cost.per_unit * cost.draft_units(512, 1, rows_before=1) == pytest.approx(
        per_row + per_row_key * 514, rel=0.2)
    keyless = measure_step_cost(_TimedModel(0.004, per_row, set()), _Blocks(), 16,
                                torch.device("cpu"))
    assert keyless.per_unit * keyless.draft_units(512, 1, rows_before=1) == pytest.approx(
        per_row, rel=0.2)


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


def _planned_at(context: int, row_key_units: float, computed: int | None = None) -> int:
    """Drafts planned for a request whose fed token sits at `context`, with `computed` tokens
    computed before the step (default: all but that token; fewer for a prompt's last chunk)."""
    cost = LinearCostModel(fixed=0.004, per_unit=0.001, row_key_units=row_key_units)
    controller = SpeculationController(MAX_K, True, cost, DraftCost(per_step=False))
    request = Request("r", list(range(context + 1)), SamplingParams())
    request.num_computed_tokens = context if computed is None else computed
    for _ in range(30):
        controller.observe_verification(request, MAX_K, 2)
    assert 0.3 < request.acceptance.estimate(controller.prior_acceptance) < 0.7
    (k,) = controller.plan([request], [MAX_K], cost.request_units(context, 1),
                           positions=None if computed is None else [context])
    return k


def test_a_draft_row_is_priced_by_the_context_it_attends():
    """The same request and acceptance (about half): a draft pays at a short context (it costs
    1 ms on a 5 ms step) and not behind 1,000 keys, where a verified row's attention makes it
    11 ms on a 15 ms step. Negative control: with no key price the long context drafts too."""
    assert _planned_at(10, row_key_units=0.01) > 0
    assert _planned_at(1000, row_key_units=0.01) == 0
    assert _planned_at(1000, row_key_units=0.0) > 0


def test_a_prompts_last_chunk_prices_its_drafts_where_they_sit():
    """Drafts after a 990-token chunk that starts at position 10 sit behind 1,000 keys, and are
    priced there (prefill_drafts.py), not at the 10 tokens computed before the step."""
    assert _planned_at(1000, row_key_units=0.01, computed=10) == 0
    assert _planned_at(10, row_key_units=0.01, computed=10) > 0  # control: the same, short


def test_the_start_up_curve_prices_a_kernel_chunk_once():
    """A forward whose 17th row starts a second chunk of 5 ms: the measured curve makes the
    17th row of a step cost its row and the chunk, and the 18th a row again. Control: a forward
    without the chunk prices every row alike."""
    import torch

    from engine.spec_decode.cost_probe import measure_step_cost

    class Blocks(_Blocks):
        num_blocks = 512

    per_row = 0.001
    chunked = measure_step_cost(_TimedModel(0.004, per_row, set(), past_16=0.005), Blocks(), 16,
                                torch.device("cpu"))
    seventeenth = chunked.per_unit * chunked.draft_units(0, 1, rows_before=16)
    assert seventeenth == pytest.approx(per_row + 0.005, rel=0.25)
    assert chunked.per_unit * chunked.draft_units(0, 2, rows_before=17) == pytest.approx(
        per_row, rel=0.4)
    plain = measure_step_cost(_TimedModel(0.004, per_row, set()), Blocks(), 16,
                              torch.device("cpu"))
    assert plain.per_unit * plain.draft_units(0, 1, rows_before=16) == pytest.approx(
        per_row, rel=0.4)


def test_sixteen_drafts_go_out_where_the_seventeenth_row_alone_does_not_pay():
    """16 requests at about half acceptance on a step whose 17th row costs 3 ms and every row
    after it 0.2 ms: one draft alone would slow the step, 16 together speed it up. The plan
    takes the best number of drafts, not the first that stops paying (which would be none)."""
    from engine.spec_decode.step_cost import RowShape

    shape = RowShape({1: 0.004, 16: 0.014, 17: 0.017, 32: 0.020})
    cost = LinearCostModel(fixed=0.004 - 0.01 / 15, per_unit=0.01 / 15, row_shape=shape)
    controller = SpeculationController(MAX_K, True, cost, DraftCost(per_step=False))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(16)]
    for request in requests:
        request.num_computed_tokens = 2
        for _ in range(30):
            controller.observe_verification(request, MAX_K, 2)
    a = requests[0].acceptance.estimate(controller.prior_acceptance)
    base = cost.units(16, 16 * 3, 16 * 3)
    # the premise: one draft alone loses, one each wins
    alone = cost(base + cost.draft_units(2, 1, rows_before=16))
    one_each = cost(base + sum(cost.draft_units(2, 1, rows_before=16 + j) for j in range(16)))
    assert (16 + a) / alone < 16 / cost(base) < (16 + 16 * a) / one_each
    ks = controller.plan(requests, [MAX_K] * 16, base, num_other_rows=16)
    assert sum(ks) >= 16 and min(ks) >= 1
    # control: where every row past the 16th costs what the 17th does, no draft pays
    dear = LinearCostModel(cost.fixed, cost.per_unit,
                           row_shape=RowShape({1: 0.004, 16: 0.014, 17: 0.017, 32: 0.062}))
    assert SpeculationController(MAX_K, True, dear, DraftCost(per_step=False)).plan(
        requests, [MAX_K] * 16, base, num_other_rows=16) == [0] * 16
