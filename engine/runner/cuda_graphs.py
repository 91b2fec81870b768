"""CUDA graphs of a padded step (static_runner.py): one per shape, captured once and replayed.

A graph replays its kernels with one host launch; on a GPU a padded decode step of the default
model is ~280 kernels, which launched one by one cost more host time than the device needs to run
them. Every shape is captured when the engine starts, as vLLM does, so no request waits for a
capture while serving; the widest shape goes first so the others reuse its memory pool. A graph's
outputs live in that shared pool: they are valid until the next replay of any shape.

Overlapped steps (overlap.py) launch step N+1 while step N still runs. On an H100 the replay of
a graph whose previous replay was still running held the host ~0.2-0.4 ms (the `forward` phase
of benchmarks/profile_step.py: 0.03 ms a synchronous step, 0.23-0.42 overlapped, both measured
2026-11-27), so the device idled while the host caught up. With `copies=2` each shape is
captured twice and consecutive replays take turns, so no replay waits on its own previous
launch. Run on an H100 (2026-11-28, docs/gpu.md), the wait stayed (0.45 ms): it is not a replay
waiting on its own copy. The copies stay until `benchmarks/experiments/overlap_trace.py`, which
times both, says what the wait is. Only shapes that overlapped steps take (`copied`: decode
steps) get the second copy; a speculative engine's verify steps never overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

Shape = TypeVar("Shape")


class StepGraphs(Generic[Shape]):
    """`run(shape)` replays the graph of `forward(shape, graphed=True)` (captured on first need,
    or at start by `capture`), or runs `forward(shape, graphed=False)` where graphs are off or a
    capture failed: a forward may do more inside a graph, where extra work costs no launches."""

    def __init__(self, forward: Callable[[Shape], tuple], device: torch.device, enabled: bool,
                 copies: int = 1, copied: Callable[[Shape], bool] = lambda shape: True):
        self.forward, self.device = forward, device
        self.enabled = enabled and device.type == "cuda"
        self.copies, self.copied = copies, copied  # `copies` of each shape `copied` accepts
        # per shape, its copies: (graph, outputs) each, replayed in turn
        self.graphs: dict[Shape, list[tuple[torch.cuda.CUDAGraph, tuple]]] = {}
        self._turn = 0
        self._eager_shapes: set[Shape] = set()  # capture failed: run these eagerly
        self._pool = None

    def capture(self, shapes: Sequence[Shape]) -> int:
        """Captures `shapes` (widest first, so that the smaller reuse its memory pool); returns
        how many graphs there are. What fails for one shape fails for all (an op that cannot be
        captured): graphs go off at the first failure rather than warn once per shape."""
        if not self.enabled:
            return 0
        started = time.perf_counter()
        for shape in shapes:
            if shape not in self.graphs and self._capture(shape) is None:
                logger.warning("CUDA graphs are off: every step runs eagerly")
                self.enabled = False
                break
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs in %.1f s", len(self.graphs),
                    time.perf_counter() - started)
        return len(self.graphs)

    def run(self, shape: Shape) -> tuple:
        if not self.enabled or shape in self._eager_shapes:
            return self.forward(shape, graphed=False)
        copies = self.graphs.get(shape) or self._capture(shape)
        if copies is None:
            return self.forward(shape, graphed=False)
        self._turn += 1
        graph, outputs = copies[self._turn % len(copies)]
        graph.replay()
        return outputs

    def _capture(self, shape: Shape):
        """Captures one shape's forward `copies` times, after a warm-up run on a side stream (as
        CUDA graphs require); returns the copies. A shape that cannot be captured runs eagerly
        from then on."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.forward(shape, graphed=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            copies = []
            for _ in range(self.copies if self.copied(shape) else 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    outputs = self.forward(shape, graphed=True)
                self._pool = graph.pool()
                copies.append((graph, outputs))
            self.graphs[shape] = copies
            return copies
        except Exception as error:  # keep serving: this shape stays eager
            logger.warning("CUDA graph capture failed for %s (%s); running it eagerly", shape,
                           error)
            self._eager_shapes.add(shape)
            return None
