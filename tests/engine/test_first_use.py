"""Every padded step shape is ready before the server says it is (engine/metrics/first_use.py,
engine/runner/static_runner.py `capture_graphs`): after the ready mark, real traffic meets no step
shape and captures no graph for the first time. Negative controls: a batch bucket left out of the
start-up warm-up is counted when a step of that size runs; a graph captured on first need after
ready is counted."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.metrics import first_use
from engine.runner.cuda_graphs import StepGraphs
from engine.runner.padded_settings import SKIP_WARM_ENV
from tests.conftest import make_llm
from tests.engine.test_cuda_graphs import CountingGraph


@pytest.fixture
def ledger(monkeypatch):
    """A fresh process ledger for the test (the real one is marked ready by a server)."""
    fresh = first_use.FirstUseLedger()
    monkeypatch.setattr(first_use, "LEDGER", fresh)
    return fresh


def test_first_uses_count_only_after_ready(ledger):
    ledger.note(first_use.STEP_SHAPE, "before")
    assert ledger.counts[first_use.STEP_SHAPE] == 0  # the warm-up's own first uses are free
    ledger.mark_ready()
    ledger.note(first_use.STEP_SHAPE, "after")
    assert ledger.counts == {first_use.GRAPH_CAPTURE: 0, first_use.STEP_SHAPE: 1,
                             first_use.KERNEL_COMPILE: 0}
    assert ledger.last[first_use.STEP_SHAPE] == "after"


def test_a_graph_captured_after_ready_is_counted_and_warmed_ones_are_not(ledger):
    graphs = StepGraphs(lambda shape, graphed: ("eager", shape), torch.device("cpu"), True)
    graphs.enabled = True  # as on CUDA; captures are stand-ins
    log: list[str] = []

    def capture(shape):
        graphs.graphs[shape] = (CountingGraph(shape, log), (f"out of {shape}",))
        return graphs.graphs[shape]

    graphs._capture = capture
    graphs.warm(["decode", "verify"])
    ledger.mark_ready()
    for shape in ("decode", "verify", "decode"):
        graphs.run(shape)
    assert ledger.counts[first_use.GRAPH_CAPTURE] == ledger.counts[first_use.STEP_SHAPE] == 0
    graphs.run("wide")  # the control: a shape the warm-up did not have
    graphs.run("wide")  # counted once
    assert ledger.counts[first_use.GRAPH_CAPTURE] == ledger.counts[first_use.STEP_SHAPE] == 1
    assert log == ["decode", "verify", "decode", "wide", "wide"]


PROMPTS = ["Hello", "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,", "def f(x):"]


def _traffic(llm) -> None:
    """Batches of 1 to 4 requests of different lengths (1, 19, 70 and 5 tokens): the batch
    shrinks step by step and the contexts cross every table width of a 96-token engine."""
    for n in range(1, len(PROMPTS) + 1):
        params = [SamplingParams(max_tokens=8 + 6 * i, temperature=0, ignore_eos=True)
                  for i in range(n)]
        llm.generate(PROMPTS[:n], params)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_after_ready_traffic_meets_no_new_step_shape(tiny_chat_model_folder, ledger, method):
    llm = make_llm(str(tiny_chat_model_folder), padded_steps=True, max_num_seqs=4,
                   max_model_len=96, speculative_method=method)
    runner = llm.engine.static_runner
    assert {s.width for s in runner.graph_shapes()} == {1, 2, 4, 6}
    ledger.mark_ready()
    _traffic(llm)
    assert ledger.counts == dict.fromkeys(first_use.DOCS, 0)


def test_a_batch_size_left_out_of_the_warm_up_is_counted(tiny_chat_model_folder, ledger,
                                                         monkeypatch):
    monkeypatch.setenv(SKIP_WARM_ENV, "2")
    llm = make_llm(str(tiny_chat_model_folder), padded_steps=True, max_num_seqs=4,
                   speculative_method="none")
    ledger.mark_ready()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ledger.counts[first_use.STEP_SHAPE] == 0  # batch 1 was warmed
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ledger.counts[first_use.STEP_SHAPE] >= 1
    assert ledger.last[first_use.STEP_SHAPE].num_seqs == 2


def test_triton_compiles_reach_the_ledger_through_its_jit_hook(ledger, monkeypatch):
    """The hook Triton calls after it builds a kernel (a GPU's; here called as Triton calls it),
    chained to any hook installed before, and installed once."""
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda *args, **kwargs: seen.append(kwargs["repr"]))
    assert first_use.count_kernel_compiles() and first_use.count_kernel_compiles()
    hook = knobs.runtime.jit_post_compile_hook
    hook(key=None, repr="paged_attention_kernel[num_warps=4](...)", fn=None, compile={},
         is_manual_warmup=False, already_compiled=False)
    assert ledger.counts[first_use.KERNEL_COMPILE] == 0  # before ready: the warm-up's own
    ledger.mark_ready()
    hook(key=None, repr="silu_mul_kernel[num_warps=4](...)", fn=None, compile={},
         is_manual_warmup=False, already_compiled=False)
    assert ledger.counts[first_use.KERNEL_COMPILE] == 1
    assert ledger.last[first_use.KERNEL_COMPILE] == "silu_mul_kernel"
    assert len(seen) == 2  # the hook installed before still runs
