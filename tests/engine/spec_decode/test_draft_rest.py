"""Requests the controller plans no draft for rest: their lookups are not computed for 1, 2, 4,
... steps (at most MAX_DRAFT_REST), so a method that does not draft costs little, alone or in a
batch. A step in which every request rests is neither planned nor fitted, and a planned draft
ends the rest."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.controller import MAX_DRAFT_REST, SpeculationController
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.speculation import Speculation
from engine.spec_decode.step_cost import DraftCost, LinearCostModel

MAX_K = 4


class CountingProposer(Proposer):
    """Counts, per request, the steps its drafts were prepared; proposes [7] * k."""
    name = "counting"

    def __init__(self):
        self.prepared: dict[str, int] = {}

    def prepare(self, requests, max_tokens):
        for request, k in zip(requests, max_tokens):
            if k > 0:
                self.prepared[request.request_id] = self.prepared.get(request.request_id, 0) + 1

    def propose(self, requests, num_tokens):
        return Proposal([[7] * k for k in num_tokens])


def run_steps(num_requests: int, acceptance: float, steps: int, max_rest: int = MAX_DRAFT_REST,
              probe_every: int = 0, per_row: float = 0.0006
              ) -> tuple[CountingProposer, list[Request], list[int]]:
    """`steps` planned steps of a batch whose requests' drafts are accepted at `acceptance`, on
    a CPU-like step (5 ms + `per_row` a row); drafts are verified and cleared after each step.
    Also returns the steps (from 0) in which some request had drafts."""
    controller = SpeculationController(MAX_K, True, LinearCostModel(0.005, per_row),
                                       DraftCost(per_step=False))
    controller.probe_every, controller.max_rest = probe_every, max_rest
    proposer = CountingProposer()
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(num_requests)]
    for request in requests:
        request.num_computed_tokens = 2
        for _ in range(30):
            controller.observe_verification(request, 10, round(10 * acceptance))
    speculation = Speculation(proposer, controller)
    drafted = []
    for step in range(steps):
        plan = SchedulerOutput([ScheduledRequest(r, 1, True, MAX_K) for r in requests])
        speculation.propose(plan, None)
        if any(r.draft_token_ids for r in requests):
            drafted.append(step)
        for request in requests:
            if request.draft_token_ids:  # verified at the batch's acceptance
                num_drafts = len(request.draft_token_ids)
                controller.observe_verification(request, num_drafts,
                                                round(num_drafts * acceptance))
            request.draft_token_ids = []
    return proposer, requests, drafted


def test_requests_planned_no_draft_rest_doubling_up_to_the_bound():
    proposer, requests, _ = run_steps(16, acceptance=0.0, steps=40)
    # rests of 1, 2, 4, 8, 8, ...: prepared on steps 1, 3, 6, 11, 20, 29, 38
    assert all(count == 7 for count in proposer.prepared.values()), proposer.prepared
    assert all(r.draft_rest == MAX_DRAFT_REST for r in requests)


def test_a_lone_request_rests_too_and_a_planned_draft_ends_the_rest():
    """At batch 1 the step is shortest, so its plan and lookup weigh most. Controls: with rests
    off a lone request is prepared every step; requests whose drafts pay never rest."""
    alone, requests, _ = run_steps(1, acceptance=0.0, steps=40)
    assert alone.prepared == {"r0": 7}
    assert requests[0].draft_rest == MAX_DRAFT_REST
    never, _, _ = run_steps(1, acceptance=0.0, steps=40, max_rest=0)
    assert never.prepared == {"r0": 40}
    drafting, requests, _ = run_steps(16, acceptance=1.0, steps=40)
    assert set(drafting.prepared.values()) == {40}
    assert all(r.draft_rest == 0 for r in requests)


def test_probes_come_every_32_steps_through_rests():
    """A step in which every request rests counts towards the next probe as a plan of no draft
    does, so a lone request is probed every ~PROBE_EVERY steps, not every 32 plans (~250 steps at
    rests of 8). Rows as dear as a step, so only probes draft. Controls: the same steps without
    rests probe every 32; with rested steps not counted, probes come once in 200 steps."""
    from engine.spec_decode.controller import SpeculationController as Controller

    def probes(**kwargs) -> list[int]:
        return run_steps(1, 0.0, 200, probe_every=32, per_row=0.005, **kwargs)[2]

    assert probes(max_rest=0) == [31, 63, 95, 127, 159, 191]
    with_rests = probes()
    assert len(with_rests) >= 5
    assert all(b - a <= 32 + MAX_DRAFT_REST for a, b in zip(with_rests, with_rests[1:]))
    counted = Controller.rested_step
    try:
        Controller.rested_step = lambda self: None
        assert len(probes()) <= 1
    finally:
        Controller.rested_step = counted


def test_a_step_where_every_request_rests_skips_the_plan_and_the_cost_fit():
    """Nothing is planned or learned in it: the step runs as `none`'s does. Control: a step in
    which one request does not rest is planned, and its time is fitted."""
    controller = SpeculationController(MAX_K, True, LinearCostModel(0.005, 0.0006),
                                       DraftCost(per_step=False))
    speculation = Speculation(CountingProposer(), controller)
    planned, fitted = [], []
    controller.plan = lambda requests, *args, **kwargs: planned.append(1) or [0] * len(requests)
    controller.observe_step = lambda *args: fitted.append(1)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(2)]
    scheduled = [ScheduledRequest(r, 1, True, MAX_K) for r in requests]

    def step(rest_left: list[int]) -> None:
        for request, left in zip(requests, rest_left):
            request.num_computed_tokens, request.draft_rest_left = 2, left
        speculation.propose(SchedulerOutput(scheduled), None)
        speculation.observe(scheduled, [0, 1], None, [[5], [5]], 2, 0.005)

    step([2, 2])
    assert (planned, fitted) == ([], [])
    step([2, 0])
    assert (planned, fitted) == ([1], [1])
