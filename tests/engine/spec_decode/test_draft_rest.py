"""Requests the controller plans no draft for rest: their lookups are not computed for 1, 2, 4,
... steps (at most MAX_DRAFT_REST, at most half the batch), so a method that does not draft
costs little in a large batch. Batch 1 does not rest, and a planned draft ends the rest."""

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


def run_steps(num_requests: int, acceptance: float,
              steps: int) -> tuple[CountingProposer, list[Request]]:
    """`steps` planned steps of a batch whose requests' drafts are accepted at `acceptance`, on
    a CPU-like step (5 ms + 0.6 ms a row); drafts are cleared after each step."""
    controller = SpeculationController(MAX_K, True, LinearCostModel(0.005, 0.0006),
                                       DraftCost(per_step=False))
    controller.probe_every = 0
    proposer = CountingProposer()
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(num_requests)]
    for request in requests:
        request.num_computed_tokens = 2
        for _ in range(30):
            controller.observe_verification(request, 10, round(10 * acceptance))
    speculation = Speculation(proposer, controller)
    for _ in range(steps):
        plan = SchedulerOutput([ScheduledRequest(r, 1, True, MAX_K) for r in requests])
        speculation.propose(plan, None)
        for request in requests:
            request.draft_token_ids = []
    return proposer, requests


def test_requests_planned_no_draft_rest_doubling_up_to_the_bound():
    proposer, requests = run_steps(16, acceptance=0.0, steps=40)
    # rests of 1, 2, 4, 8, 8, ...: prepared on steps 1, 3, 6, 11, 20, 29, 38
    assert all(count == 7 for count in proposer.prepared.values()), proposer.prepared
    assert all(r.draft_rest == MAX_DRAFT_REST for r in requests)


def test_batch_one_does_not_rest_and_a_planned_draft_ends_the_rest():
    """Controls: a lone request is prepared every step; requests whose drafts pay never rest."""
    alone, _ = run_steps(1, acceptance=0.0, steps=40)
    assert alone.prepared == {"r0": 40}
    drafting, requests = run_steps(16, acceptance=1.0, steps=40)
    assert set(drafting.prepared.values()) == {40}
    assert all(r.draft_rest == 0 for r in requests)


def test_a_small_batch_rests_at_most_half_its_size():
    proposer, requests = run_steps(4, acceptance=0.0, steps=20)
    # rests of 1, 2, 2, ...: prepared on steps 1, 3, 6, 9, 12, 15, 18
    assert set(proposer.prepared.values()) == {7}
    assert all(r.draft_rest == 2 for r in requests)
