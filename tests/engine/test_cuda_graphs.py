"""Graph replays (engine/runner/cuda_graphs.py). The capture itself needs CUDA (the GPU machine's
tests/engine/test_static_runner.py replays every shape); here the captures are stand-ins that
count their replays."""

from __future__ import annotations

import torch

from engine.runner.cuda_graphs import StepGraphs


class CountingGraph:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


def test_a_shape_is_captured_once_and_every_step_of_it_replays_that_graph():
    graphs = StepGraphs(lambda shape, graphed: ("eager", shape), torch.device("cpu"), True)
    graphs.enabled = True  # as on CUDA
    log: list[str] = []
    captures: list[str] = []

    def capture(shape):
        captures.append(shape)
        graphs.graphs[shape] = (CountingGraph(shape, log), (f"out of {shape}",))
        return graphs.graphs[shape]

    graphs._capture = capture
    outputs = [graphs.run(shape)[0] for shape in ("decode", "verify", "decode", "decode")]
    assert captures == ["decode", "verify"]  # each shape once
    assert log == ["decode", "verify", "decode", "decode"]  # every step replays its shape's
    assert outputs == ["out of decode", "out of verify", "out of decode", "out of decode"]
    graphs.enabled = False  # the control: graphs off, every step runs eagerly
    assert graphs.run("decode") == ("eager", "decode") and len(log) == 4
