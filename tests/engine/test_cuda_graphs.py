"""Graph replays taking turns (engine/runner/cuda_graphs.py). The capture itself needs CUDA (the
GPU machine's tests/engine/test_static_runner.py replays every shape); here the captures are
stand-ins that count their replays."""

from __future__ import annotations

import torch

from engine.runner.cuda_graphs import StepGraphs
from engine.runner.static_runner import StaticStepRunner, StepShape


class CountingGraph:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


def graphs_with_stand_ins(copies: int) -> tuple[StepGraphs, list[str]]:
    graphs = StepGraphs(lambda shape, graphed: ("eager", shape), torch.device("cpu"), True,
                        copies)
    graphs.enabled = True  # as on CUDA
    log: list[str] = []

    def capture(shape):
        graphs.graphs[shape] = [(CountingGraph(f"{shape}:{i}", log), (f"out{i}",))
                                for i in range(copies)]
        return graphs.graphs[shape]

    graphs._capture = capture
    return graphs, log


def test_consecutive_replays_take_turns_between_copies():
    graphs, log = graphs_with_stand_ins(copies=2)
    outputs = [graphs.run("decode")[0] for _ in range(4)]
    # no replay follows one of its own copy: overlapped, it would wait for that copy to finish
    assert all(a != b for a, b in zip(log, log[1:])) and set(log) == {"decode:0", "decode:1"}
    assert outputs == ["out1", "out0", "out1", "out0"]  # each replay's own outputs
    single, single_log = graphs_with_stand_ins(copies=1)  # the control: one copy, no turns
    for _ in range(3):
        single.run("decode")
    assert single_log == ["decode:0"] * 3


def test_engines_whose_steps_overlap_capture_two_copies():
    def runner(async_scheduling, speculation=False):
        config = type("Config", (), {})()
        config.speculative = type("Spec", (), {"enabled": speculation,
                                               "num_speculative_tokens": 3})()
        config.scheduler = type("Sched", (), {"max_num_seqs": 4,
                                              "async_scheduling": async_scheduling})()
        config.model = type("Model", (), {"enforce_eager": False})()
        limits = type("Limits", (), {"block_size": 16, "num_kv_blocks": 8,
                                     "max_model_len": 64})()
        return StaticStepRunner.for_engine(config, None, None, limits, torch.device("cpu"),
                                           "torch")

    assert runner(True).graphs.copies == 2
    assert runner(False).graphs.copies == 1
    assert runner(None).graphs.copies == 1  # CPU's default: no overlap
    # a speculative engine's quiet steps overlap too; its verify steps never do
    graphs = runner(True, speculation=True).graphs
    assert graphs.copies == 2
    assert graphs.copied(StepShape(1, 1, 4)) and not graphs.copied(StepShape(1, 4, 4))
