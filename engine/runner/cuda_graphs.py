"""CUDA graphs of a padded step (static_runner.py): one per shape, captured once and replayed.

A graph replays its kernels with one host launch; on a GPU a padded decode step of the default
model is ~280 kernels, which launched one by one cost more host time than the device needs to run
them. Every shape is captured when the engine starts, as vLLM does, so no request waits for a
capture while serving; the widest shape goes first so the others reuse its memory pool. A graph's
outputs live in that shared pool: they are valid until the next replay of any shape.

Overlapped steps (overlap.py) launch step N+1 while step N still runs, replaying the same
graph. A second copy of each graph, replays taking turns, was tried against a replay waiting on
its own previous launch: on an H100 (2026-11-28, benchmarks/experiments/overlap_trace.py) it made
an overlapped batch-1 step slower, 1.56 ms against 1.36 with one graph (synchronous: 1.47), and
each launch cost the host 0.135 ms against 0.08 (docs/gpu.md).

Where graphs are off on CUDA (`--enforce-eager`, or a capture failed), `warm` runs each shape once
eagerly instead: its Triton kernels compile and CUDA loads its modules before the first request.
On a CPU nothing compiles at first use, so there the shapes are only recorded. Either way every
shape first met after the server turned ready is counted (engine/metrics/first_use.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from engine.metrics import first_use

logger = logging.getLogger(__name__)

Shape = TypeVar("Shape")


class StepGraphs(Generic[Shape]):
    """`run(shape)` replays the graph of `forward(shape, graphed=True)` (captured on first need,
    or at start by `warm`), or runs `forward(shape, graphed=False)` where graphs are off or a
    capture failed: a forward may do more inside a graph, where extra work costs no launches."""

    def __init__(self, forward: Callable[[Shape], tuple], device: torch.device, enabled: bool):
        self.forward, self.device = forward, device
        self.enabled = enabled and device.type == "cuda"
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # (graph, outputs)
        self.warmed: set[Shape] = set()  # captured, run, or (on a CPU) recorded at least once
        self._eager_shapes: set[Shape] = set()  # capture failed: run these eagerly
        self._pool = None

    def warm(self, shapes: Sequence[Shape]) -> int:
        """Makes `shapes` ready: captures them (widest first, so that the smaller reuse its
        memory pool), or on CUDA without graphs runs each once; on a CPU records them. Returns
        how many graphs there are. What fails for one shape fails for all (an op that cannot be
        captured): graphs go off at the first failure rather than warn once per shape, and the
        shapes left run eagerly."""
        started = time.perf_counter()
        for shape in shapes:
            if shape in self.warmed:
                continue
            if self.enabled and self._capture(shape) is None:
                logger.warning("CUDA graphs are off: every step runs eagerly")
                self.enabled = False
            if not self.enabled and self.device.type == "cuda":
                self.forward(shape, graphed=False)
            self.warmed.add(shape)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("%d step shapes ready (%d CUDA graphs) in %.1f s", len(self.warmed),
                    len(self.graphs), time.perf_counter() - started)
        return len(self.graphs)

    def run(self, shape: Shape) -> tuple:
        if shape not in self.warmed:  # a stall on a GPU: the start-up list missed this shape
            first_use.ledger().note(first_use.STEP_SHAPE, shape)
            self.warmed.add(shape)
        if not self.enabled or shape in self._eager_shapes:
            return self.forward(shape, graphed=False)
        captured = self.graphs.get(shape)
        if captured is None:
            first_use.ledger().note(first_use.GRAPH_CAPTURE, shape)
            captured = self._capture(shape)
        if captured is None:
            return self.forward(shape, graphed=False)
        graph, outputs = captured
        graph.replay()
        return outputs

    def _capture(self, shape: Shape):
        """Captures one shape's forward, after a warm-up run on a side stream (as CUDA graphs
        require); returns (graph, outputs). A shape that cannot be captured runs eagerly from
        then on."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.forward(shape, graphed=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.forward(shape, graphed=True)
            self._pool = graph.pool()
            self.graphs[shape] = (graph, outputs)
            return self.graphs[shape]
        except Exception as error:  # keep serving: this shape stays eager
            logger.warning("CUDA graph capture failed for %s (%s); running it eagerly", shape,
                           error)
            self._eager_shapes.add(shape)
            return None
