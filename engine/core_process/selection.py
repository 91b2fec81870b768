"""Which engine core a server runs: in a thread of its process, or in a process of its own.

`auto` picks per device, from measurements. On CUDA the process: on an H200 (random weights in
the default model's shape, bf16; benchmarks/results/engine_core_check_h200_2026-12-04.json) it
served 581 against 383 tok/s at batch 1 and 11,361 against 5,889 at 64 concurrent streams (equal
at 16), since the front's Python (SSE, JSON, templates) no longer holds the GIL that the step needs
to launch its kernels. On a CPU the thread: on a 2-core Zen 4 the two modes were equal within the
noise (benchmarks/results/engine_core_modes_epyc_zen4_cpu_*.json), and the thread costs a
process less (a second Python with torch and the tokenizer loaded).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig

ENGINE_CORE_CHOICES = ("auto", "thread", "process")


def resolve_engine_core(choice: str, config: EngineConfig) -> str:
    """"thread" or "process" for `choice` (one of ENGINE_CORE_CHOICES) on the config's device."""
    if choice not in ENGINE_CORE_CHOICES:
        raise ValueError(f"engine core must be one of {', '.join(ENGINE_CORE_CHOICES)}, "
                         f"got {choice!r}")
    if choice != "auto":
        return choice
    from engine.core.device import pick_device

    return "process" if pick_device(config.model.device).type == "cuda" else "thread"


def engine_factory(choice: str, config: EngineConfig) -> Callable[[], object]:
    """A function that builds the chosen engine (AsyncEngine or EngineCoreClient) and returns
    once it has loaded; call it off the event loop."""
    if resolve_engine_core(choice, config) == "process":
        from engine.core_process.client import EngineCoreClient

        return lambda: EngineCoreClient(config)
    from engine.async_engine import AsyncEngine

    return lambda: AsyncEngine.from_config(config)
