"""Tests of the Scheduler: token budget, chunked prefill, max_num_seqs, preemption by recompute,
abort and the stop conditions; then whole runs driven by a fake model that reads its history back
from a simulated paged KV cache, so wrong block bookkeeping shows up as wrong output."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
TOKEN = 7  # what the fake sampler returns in the unit tests


def make_scheduler(num_blocks=64, budget=32, max_num_seqs=8, max_model_len=1024,
                   prefix_caching=True) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK_SIZE, prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, manager, max_model_len)


def make_request(request_id: str, num_prompt: int, first: int = 10, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(request_id, list(range(first, first + num_prompt)), SamplingParams(**params),
                   eos_token_ids=frozenset({EOS}))


def run_step(scheduler: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    out = scheduler.schedule()
    sampled = [[token] if s.samples_token else [] for s in out.scheduled]
    return out, scheduler.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples_token) for s in out.scheduled]


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    scheduler = make_scheduler(budget=32)
    request = make_request("a", 100)
    scheduler.add(request)
    computed, tables = [], []
    for expected in [("a", 32, False), ("a", 32, False), ("a", 32, False), ("a", 4, True)]:
        out, _ = run_step(scheduler)
        assert plan(out) == [expected]
        computed.append(request.num_computed_tokens)
        tables.append(len(request.block_table))
    assert computed == [32, 64, 96, 100] and tables == [8, 16, 24, 25]
    assert request.output_token_ids == [TOKEN] and request.status == RequestStatus.RUNNING
    out, _ = run_step(scheduler)
    assert plan(out) == [("a", 1, True)] and request.num_computed_tokens == 101


def test_running_decodes_go_before_waiting_prefills():
    scheduler = make_scheduler(budget=16)
    scheduler.add(make_request("a", 4))
    run_step(scheduler)
    scheduler.add(make_request("b", 40, first=100))
    plans = [plan(run_step(scheduler)[0]) for _ in range(3)]
    assert plans == [[("a", 1, True), ("b", 15, False)], [("a", 1, True), ("b", 15, False)],
                     [("a", 1, True), ("b", 10, True)]]


def test_budget_is_filled_exactly_and_the_last_admission_is_chunked():
    scheduler = make_scheduler(budget=32)
    requests = [make_request(f"r{i}", 10, first=100 * i) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    out, _ = run_step(scheduler)
    assert plan(out) == [("r0", 10, True), ("r1", 10, True), ("r2", 10, True), ("r3", 2, False)]
    assert out.num_batched_tokens == 32
    assert scheduler.running == requests[:4] and list(scheduler.waiting) == requests[4:]
    out, _ = run_step(scheduler)
    assert plan(out) == [("r0", 1, True), ("r1", 1, True), ("r2", 1, True), ("r3", 8, True),
                         ("r4", 10, True)]
    assert out.num_batched_tokens == 21


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 4, first=100 * i, max_tokens=2) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    out, _ = run_step(scheduler)
    assert [s.request for s in out.scheduled] == requests[:2] and len(scheduler.waiting) == 2
    out, finished = run_step(scheduler)
    assert [s.request for s in out.scheduled] == requests[:2] and finished == requests[:2]
    out, _ = run_step(scheduler)
    assert [s.request for s in out.scheduled] == requests[2:] and scheduler.running == requests[2:]


def test_the_newest_running_request_is_preempted_and_resumed():
    scheduler = make_scheduler(num_blocks=7, budget=64)
    manager = scheduler.block_manager
    a, b, c = (make_request(n, 8, first=100 * i, max_tokens=3) for i, n in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add(request)
    run_step(scheduler)  # 6 of 7 blocks held
    d = make_request("d", 4, first=900)
    scheduler.add(d)
    c_head = c.block_table[0]
    out, _ = run_step(scheduler)  # a takes the last block, b needs one more: c goes
    assert plan(out) == [("a", 1, True), ("b", 1, True)] and out.preempted == [c]
    assert c.status == RequestStatus.WAITING and c.block_table == [] and c.block_hashes == []
    assert c.num_computed_tokens == 0 and c.output_token_ids == [TOKEN]
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [c, d] and scheduler.running == [a, b]  # d not admitted
    assert sum(manager.ref_counts) == 6 and manager.num_free_blocks == 1
    out, finished = run_step(scheduler)  # c's head is cached but one more block is missing
    assert plan(out) == [("a", 1, True), ("b", 1, True)] and finished == [a, b]
    assert list(scheduler.waiting) == [c, d] and out.preempted == []
    out, _ = run_step(scheduler)
    assert plan(out) == [("c", 5, True), ("d", 4, True)]
    assert c.block_table[0] == c_head and c.num_cached_prompt_tokens == 4
    run_step(scheduler)
    assert c.status == RequestStatus.FINISHED_LENGTH and c.output_token_ids == [TOKEN] * 3
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1


def test_several_victims_keep_their_order_in_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=3, prefix_caching=False)
    a, b, c = (make_request(n, 4, first=100 * i) for i, n in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add(request)
    run_step(scheduler)
    out, _ = run_step(scheduler)  # a grows by evicting c; b cannot grow and preempts itself
    assert plan(out) == [("a", 1, True)] and out.preempted == [c, b]
    assert list(scheduler.waiting) == [b, c] and scheduler.running == [a]
    assert scheduler.num_preemptions == 2 and len(a.block_table) == 2
    assert scheduler.block_manager.num_free_blocks == 1


def test_abort_from_waiting_and_from_running_frees_blocks():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6, first=50)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 6
    scheduler.abort(b)
    assert b.status == RequestStatus.FINISHED_ABORTED and not scheduler.waiting
    out = scheduler.schedule()
    scheduler.abort(a)  # between schedule and update: the step's result is dropped
    assert scheduler.update_from_output(out, [[TOKEN]]) == []
    assert a.status == RequestStatus.FINISHED_ABORTED and a.output_token_ids == [TOKEN]
    assert a.block_table == [] and scheduler.block_manager.ref_counts == [0] * 8
    assert scheduler.block_manager.num_free_blocks == 8 and scheduler.num_unfinished == 0
    assert scheduler.schedule().is_empty


@pytest.mark.parametrize("params, sampled, status, stop_reason", [
    (dict(), EOS, RequestStatus.FINISHED_STOPPED, ...),  # EOS's stop_reason: not pinned
    (dict(ignore_eos=True), EOS, RequestStatus.RUNNING, None),
    (dict(stop_token_ids=[9]), 9, RequestStatus.FINISHED_STOPPED, 9),
    (dict(stop_token_ids=[9]), TOKEN, RequestStatus.RUNNING, None),
    (dict(max_tokens=1), TOKEN, RequestStatus.FINISHED_LENGTH, None),
    (dict(max_tokens=1, ignore_eos=True), EOS, RequestStatus.FINISHED_LENGTH, None),
])
def test_stop_conditions(params, sampled, status, stop_reason):
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("a", 6, **params)
    scheduler.add(request)
    _, finished = run_step(scheduler, token=sampled)
    assert request.output_token_ids == [sampled] and request.status == status
    assert stop_reason is ... or request.stop_reason == stop_reason
    assert finished == ([request] if status.finished else [])
    assert (request in scheduler.running) != status.finished
    assert (scheduler.block_manager.num_free_blocks == 8) == status.finished


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("a", 6)
    scheduler.add(request)
    assert run_step(scheduler)[1] == []
    assert run_step(scheduler)[1] == [request]
    assert request.num_tokens == 8 and request.status == RequestStatus.FINISHED_LENGTH


def test_partial_prefill_samples_nothing():
    scheduler = make_scheduler(budget=4)
    request = make_request("a", 6)
    scheduler.add(request)
    out, _ = run_step(scheduler)
    assert plan(out) == [("a", 4, False)] and request.output_token_ids == []


def test_prefix_cache_hit_skips_cached_tokens():
    scheduler = make_scheduler()
    a = make_request("a", 10)
    scheduler.add(a)
    run_step(scheduler)
    b = Request("b", list(range(10, 18)) + [1, 1], SamplingParams(), frozenset({EOS}))
    scheduler.add(b)
    out, _ = run_step(scheduler)
    assert plan(out) == [("a", 1, True), ("b", 2, True)]
    assert b.num_cached_prompt_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    stats = scheduler.block_manager.prefix_stats
    assert (stats.queries, stats.hits) == (20, 8)


# ------------------------------------------------------------------ whole runs, fake model
VOCAB = 50


def next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the whole token history."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 2654435761 + len(history)) % VOCAB


def reference_output(request: Request, max_model_len: int) -> list[int]:
    tokens, output = list(request.prompt_token_ids), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token == EOS or len(output) == request.sampling_params.max_tokens \
                or len(tokens) >= max_model_len:
            return output


def make_workload() -> list[Request]:
    shared = [3, 4, 5, 6, 7, 8, 9, 10]  # two full blocks that several prompts share
    requests = []
    for i in range(8):
        prompt = (shared if i % 2 == 0 else []) + [11 + i] * (1 + i)
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i),
                                eos_token_ids=frozenset({EOS})))
    return requests


def run_to_completion(scheduler: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    manager, config = scheduler.block_manager, scheduler.config
    kv = [[None] * BLOCK_SIZE for _ in range(manager.num_blocks)]  # token id held by each slot
    for request in requests:
        scheduler.add(request)
    for _ in range(1000):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        assert not out.is_empty
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        held = [0] * manager.num_blocks
        for request in scheduler.running:
            for block_id in request.block_table:
                held[block_id] += 1
        assert manager.ref_counts == held
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in scheduler.waiting)
        sampled = []
        for s in out.scheduled:
            request, start = s.request, s.request.num_computed_tokens
            assert s.num_new_tokens >= 1
            for pos in range(start, start + s.num_new_tokens):
                block_id, offset = request.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                token = request.all_token_ids[pos]
                # A published block is shared and must never be overwritten with other content.
                assert manager.block_hash[block_id] is None or kv[block_id][offset] == token
                kv[block_id][offset] = token
            history = [kv[request.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                       for p in range(start + s.num_new_tokens)]
            sampled.append([next_token(history)] if s.samples_token else [])
        scheduler.update_from_output(out, sampled)
    assert not scheduler.num_unfinished, "the run did not finish"
    assert manager.num_free_blocks == manager.num_blocks
    return {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_do_not_depend_on_the_kv_pool_size(prefix_caching):
    max_model_len = 64
    expected = {r.request_id: reference_output(r, max_model_len) for r in make_workload()}
    huge = make_scheduler(1000, budget=16, max_num_seqs=4, max_model_len=max_model_len,
                          prefix_caching=prefix_caching)
    assert run_to_completion(huge, make_workload()) == expected
    assert huge.num_preemptions == 0
    tiny = make_scheduler(9, budget=16, max_num_seqs=4, max_model_len=max_model_len,
                          prefix_caching=prefix_caching)
    tiny_requests = make_workload()
    assert run_to_completion(tiny, tiny_requests) == expected
    assert tiny.num_preemptions > 0
    assert tiny.num_preemptions == sum(r.num_preemptions for r in tiny_requests)
    assert all(r.status != RequestStatus.FINISHED_ABORTED for r in tiny_requests)
