"""Padded decode/verify steps over persistent buffers (engine/runner/static_runner.py): the layout CUDA
graphs replay, run eagerly here. They must give exactly the tokens of the flat, unpadded steps."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.host_overhead import KernelCount
from engine import SamplingParams
from engine.attention import triton_backend
from engine.models.triton_ops import TritonOps
from engine.runner.static_runner import StaticStepRunner, StepShape, bucket_for, power_of_two_bucket
from tests.conftest import TEST_DEVICE, make_llm
from tests.engine.test_spec_decode_engine import PROMPTS

# Different lengths, so the batch shrinks step by step and lands between buckets.
PARAMS = [SamplingParams(max_tokens=12 + 5 * i, temperature=0, ignore_eos=True)
          for i in range(len(PROMPTS))]
METHODS = {
    "none": {"speculative_method": "none"},
    "layer-skip": {"speculative_method": "layer-skip", "draft_layer_ids": (0, 2),
                   "adaptive": False, "num_speculative_tokens": 4},
}


def test_buckets_and_widths():
    buckets = (1, 2, 4, 6)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert [power_of_two_bucket(n, 40) for n in (1, 2, 3, 5, 17, 33)] == [1, 2, 4, 8, 32, 40]


def runner_without_model(**options) -> StaticStepRunner:
    options = {"max_num_seqs": 6, "max_query_len": 6, "max_model_len": 100,
               "use_graphs": False, **options}
    return StaticStepRunner(None, None, block_size=16, scratch_block=10,
                            device=torch.device("cpu"), **options)


def test_graph_shapes_are_every_bucket_query_length_and_width():
    shapes = runner_without_model().graph_shapes()  # 7 blocks hold 100 tokens
    assert len(shapes) == len(set(shapes)) == 4 * 4 * 4
    assert {s.num_seqs for s in shapes} == {1, 2, 4, 6}
    assert {s.query_len for s in shapes} == {1, 2, 4, 6}
    assert [s.width for s in shapes] == sorted(s.width for s in shapes)  # narrowest first
    assert {s.width for s in shapes} == {1, 2, 4, 7}
    # Full-width tables (the Triton backend): one width, 16 graphs.
    full = runner_without_model(full_width_tables=True).graph_shapes()
    assert {s.width for s in full} == {7} and len(full) == 16


def test_startup_capture_goes_widest_first_over_padding_and_stops_at_a_failure(monkeypatch):
    """The orchestration of `capture_graphs` (the capture itself needs CUDA: on a GPU machine
    `test_padded_steps_give_the_flat_steps_tokens` checks that every shape was captured)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner = runner_without_model()
    runner.graphs.enabled = True
    runner.slot_mapping.fill_(3)
    runner.context_lens.fill_(50)
    captured: list[StepShape] = []

    def fake_capture(shape):
        assert runner.slot_mapping.eq(runner.scratch_slot).all()  # padding writes scratch only
        assert runner.context_lens.eq(1).all()
        captured.append(shape)
        runner.graphs.graphs[shape] = ("graph", None)
        return runner.graphs.graphs[shape]

    runner.graphs._capture = fake_capture
    assert runner.capture_graphs() == 64
    assert captured == runner.graph_shapes()[::-1] and runner.graphs.enabled

    failing = runner_without_model()
    failing.graphs.enabled = True
    failing.graphs._capture = lambda shape: captured.append(shape)  # returns None: a failure
    captured.clear()
    assert failing.capture_graphs() == 0
    assert len(captured) == 1 and not failing.graphs.enabled


@pytest.fixture(params=["fused-cpu-ops", "torch-ops"])
def ops(request, monkeypatch):
    if request.param == "torch-ops":  # what CUDA runs
        monkeypatch.setattr("engine.quant.kernels.load_kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("method", list(METHODS))
def test_padded_steps_give_the_flat_steps_tokens(tiny_chat_model_folder, method, ops):
    folder = str(tiny_chat_model_folder)
    flat = make_llm(folder, padded_steps=False, **METHODS[method]).generate(PROMPTS, PARAMS)
    llm = make_llm(folder, padded_steps=True, max_num_seqs=6, **METHODS[method])
    runner = llm.engine.static_runner
    shapes, buffers = [], set()
    model = llm.engine.runner.model
    prepare, hidden_states = runner.prepare, model.hidden_states

    def spy_prepare(scheduled, *in_flight):  # overlapped steps (CUDA's default) pass it
        step = prepare(scheduled, *in_flight)
        shapes.append((len(scheduled), step.shape))
        return step

    def spy_hidden_states(input_ids, *args, **kwargs):
        buffers.add(input_ids.untyped_storage().data_ptr())
        return hidden_states(input_ids, *args, **kwargs)

    runner.prepare = spy_prepare
    captures = []
    runner.graphs._capture = captures.append
    padded = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in padded] == [o.token_ids for o in flat]
    # Every step took a shape captured at start (on CUDA; on CPU all run eagerly).
    assert {shape for _, shape in shapes} <= set(runner.graph_shapes())
    assert captures == []
    # The padded path really ran, with padding, reading its persistent buffers.
    assert len(shapes) > 20
    assert any(shape.num_seqs > real for real, shape in shapes)
    if method != "none":
        assert any(shape.query_len > 1 for _, shape in shapes)
        assert sum(o.spec_stats.num_accepted_tokens for o in padded) > 0
    if runner.graphs.enabled:  # CUDA: the steps replayed graphs (captured over the buffers)
        assert set(runner.graphs.graphs) == set(runner.graph_shapes())
    else:
        model.hidden_states = spy_hidden_states
        llm.generate(PROMPTS[:3], PARAMS[:3])
        assert runner.fed_ids.untyped_storage().data_ptr() in buffers
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("num_speculative_tokens", [0, 3])
def test_a_padded_step_runs_few_kernels_per_layer(tiny_chat_model_folder, monkeypatch,
                                                  num_speculative_tokens):
    """On a GPU a replayed graph costs about its kernel count: a decoder layer of a decode or
    verify step stays within 24 ops on the torch path (51 before the rotation was shared by q
    and k and looked up once per step, the padded layout read as a view, and the mask made
    additive once per step). Counted at dispatch, on whatever device the tests use."""
    monkeypatch.setattr("engine.quant.kernels.load_kernel", lambda: None)  # the CUDA path
    method = ({"speculative_method": "none"} if num_speculative_tokens == 0 else
              {"speculative_method": "layer-skip", "draft_layer_ids": (0,), "adaptive": False,
               "num_speculative_tokens": num_speculative_tokens})
    # Eager: a graph replays what the eager forward dispatches, and a replay runs no Python.
    llm = make_llm(str(tiny_chat_model_folder), padded_steps=True, max_num_seqs=4,
                   enforce_eager=True, **method)
    layer, runner = llm.engine.runner.model.layers[1], llm.engine.static_runner
    counts: list[Counter[str]] = []
    query_lens: list[int] = []
    forward, run = layer.forward, runner.run

    def counted_forward(*args, **kwargs):
        triton_calls.clear()  # the other layers' launches are not this one's
        with KernelCount() as count:
            out = forward(*args, **kwargs)
        counts.append(count.ops + triton_calls)
        return out

    # Triton kernels are no aten ops: count their launches beside the dispatched ops.
    triton_calls: Counter[str] = Counter()
    for owner, name in ((TritonOps, "rotate_and_store"), (TritonOps, "silu_mul"),
                        (triton_backend, "paged_attention_short")):
        def counting(*args, _name=name, _original=getattr(owner, name)):
            triton_calls["triton:" + _name] += 1
            return _original(*args)
        monkeypatch.setattr(owner, name, staticmethod(counting) if owner is TritonOps
                            else counting)

    def padded_run(step, *args, **kwargs):  # count the layer in padded steps only
        layer.forward = counted_forward
        query_lens.append(step.shape.query_len)
        try:
            return run(step, *args, **kwargs)
        finally:
            layer.forward = forward

    runner.run = padded_run
    llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3)
    assert len(counts) == len(query_lens) > 4
    assert max(query_lens) == 1 + num_speculative_tokens
    per_layer = max(sum(c.values()) for c in counts)
    # CUDA: two norms, two projections, two projections with their residual add, an output
    # buffer, and the three Triton kernels (rotate-and-store, attention, silu_mul)
    assert 7 <= per_layer <= (10 if TEST_DEVICE.type == "cuda" else 24), counts


def test_the_controller_prices_padded_steps_by_their_rows(tiny_chat_model_folder):
    llm = make_llm(str(tiny_chat_model_folder), padded_steps=True, max_num_seqs=6,
                   speculative_method="ngram", num_speculative_tokens=3)
    engine = llm.engine
    controller, runner = engine.controller, engine.static_runner
    shapes, observed, layouts = [], [], []
    prepare, observe_step, plan = runner.prepare, controller.observe_step, controller.plan

    def spy_prepare(scheduled, *in_flight):
        step = prepare(scheduled, *in_flight)
        if not engine.speculation.rested:  # a step where every request rested is not fitted
            shapes.append(step.shape)
        return step

    runner.prepare = spy_prepare
    controller.observe_step = lambda n, *rest: (observed.append(n), observe_step(n, *rest))
    controller.plan = lambda requests, max_ks, num_other, padded=None, *rest: (
        layouts.append(padded), plan(requests, max_ks, num_other, padded, *rest))[1]
    llm.generate(PROMPTS, PARAMS)
    # Every padded step fitted taught the cost model its padded rows, not its real tokens.
    assert observed == [s.num_seqs * s.query_len for s in shapes]
    assert any(s.num_seqs > 1 for s in shapes)
    assert any(layout is not None for layout in layouts)
    layout = next(layout for layout in layouts if layout is not None)
    assert [layout(depth) for depth in range(4)] == [
        layout(0), 2 * layout(0), 4 * layout(0), 4 * layout(0)]


class _Decoding:
    """A scheduled decode request with `context` tokens, its blocks numbered from `first`."""

    def __init__(self, context: int, first: int):
        self.num_fed_tokens = self.num_new_tokens = 1
        self.samples_token = True
        self.request = type("Request", (), {
            "all_token_ids": list(range(context)), "num_computed_tokens": context - 1,
            "draft_token_ids": [], "block_table": list(range(first, first + 8))})()


@pytest.mark.parametrize("full_width", [True, False])
def test_tables_send_only_the_blocks_up_to_each_context(full_width):
    """One scatter writes a step's inputs; of each block table only the blocks up to its
    context travel (a full-width table is ~32k entries a step at 64 requests). Past them, the
    torch backend's width is cleared (it gathers every block of the width) and the Triton
    kernel's stays as it was (it reads up to the context only)."""
    runner = runner_without_model(max_query_len=1, full_width_tables=full_width)
    runner.prepare([_Decoding(100, first=20)])  # 7 blocks
    step = runner.prepare([_Decoding(20, first=40), _Decoding(60, first=60)])  # 2 and 4 blocks
    assert step.shape.width == (7 if full_width else 4)
    assert runner.context_lens[:2].tolist() == [20, 60]
    assert runner.block_tables[1, :4].tolist() == [60, 61, 62, 63]
    row = runner.block_tables[0, :step.shape.width].tolist()
    assert row == ([40, 41, 22, 23, 24, 25, 26] if full_width else [40, 41, 0, 0])
