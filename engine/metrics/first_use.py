"""What a serving process first meets after it said it was ready: graph captures, step shapes and
Triton kernel compiles. Each one is a stall that some request pays for (a capture or a compile
takes tens to hundreds of milliseconds on a GPU), so after `/ready` all three stay at 0 when the
start-up warm-up covered every shape (engine/runner/static_runner.py `capture_graphs`,
server/lifecycle.py).

The words:
- a *step shape* is a padded step's (batch bucket, query length, table width): the key of a CUDA
  graph; the start-up list is every shape a step can produce, so one met for the first time after
  ready means that list missed it (testable on a CPU, where nothing is captured);
- a *graph capture* after ready is a CUDA graph recorded while serving;
- a *kernel compile* is a Triton kernel specialization launched for the first time in the process
  (compiled, or loaded from Triton's disk cache).

One ledger per process (`LEDGER`): the engine runs in the server's process, Triton's compile hook
is process-wide, and the server marks the moment it turns ready. Counts are plain ints bumped on
the engine's thread and read at scrape time (one read each, safe under the GIL).
"""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

GRAPH_CAPTURE = "graph_captures_after_ready"
STEP_SHAPE = "shape_first_use_after_ready"
KERNEL_COMPILE = "kernel_compiles_after_ready"
DOCS = {
    GRAPH_CAPTURE: "CUDA graphs captured after the server was ready (each one a stall)",
    STEP_SHAPE: "Padded step shapes (batch bucket, query length, table width) first met after "
                "the server was ready: shapes the start-up warm-up left out",
    KERNEL_COMPILE: "Triton kernel specializations first launched after the server was ready "
                    "(compiled, or loaded from the disk cache)",
}


class FirstUseLedger:
    def __init__(self):
        self.ready = False
        self.counts = dict.fromkeys(DOCS, 0)
        self.last: dict[str, object] = {}  # per kind, the last thing counted (for the log)

    def mark_ready(self) -> None:
        """From now on, every first use counts."""
        self.ready = True

    def note(self, kind: str, what: object) -> None:
        """A first use of `what` (a shape, a kernel's name): counted once ready, else free."""
        if not self.ready:
            return
        self.counts[kind] += 1
        self.last[kind] = what
        logger.warning("first use after ready (%s): %s", kind.removesuffix("_after_ready"), what)


LEDGER = FirstUseLedger()


def ledger() -> FirstUseLedger:
    """The process's ledger (looked up at each call, so a test can swap it)."""
    return LEDGER


def count_kernel_compiles() -> bool:
    """Chains a hook into Triton's JIT that notes every kernel specialization it builds (Triton
    >= 3.4 `knobs.runtime.jit_post_compile_hook`); False where Triton or the hook is missing.
    Idempotent."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    previous = runtime.jit_post_compile_hook
    if getattr(previous, "_specserve_counter", False):
        return True

    def on_compile(*args, **kwargs):
        name = kwargs.get("repr") or kwargs.get("fn") or "a Triton kernel"
        ledger().note(KERNEL_COMPILE, str(name).split("[", 1)[0])
        if previous is not None:
            return previous(*args, **kwargs)
        return None

    on_compile._specserve_counter = True
    runtime.jit_post_compile_hook = on_compile
    return True


class FirstUseCollector(Collector):
    """The ledger's counts as Prometheus counters `<prefix>:<kind>_total`."""

    def __init__(self, model_name: str, prefix: str):
        self.model_name, self.prefix = model_name, prefix

    def collect(self):
        counts = ledger().counts
        for kind, documentation in DOCS.items():
            counter = CounterMetricFamily(f"{self.prefix}:{kind}", documentation,
                                          labels=["model_name"])
            counter.add_metric([self.model_name], counts[kind])
            yield counter
