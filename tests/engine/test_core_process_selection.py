"""engine/core_process/selection.py: `--engine-core auto` is the thread on a CPU (measured faster
there) and the process on CUDA; an explicit choice is kept; anything else is refused."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.core_process.selection import resolve_engine_core


def test_auto_is_the_thread_on_cpu_and_explicit_choices_are_kept():
    config = EngineConfig.from_kwargs(device="cpu")
    assert resolve_engine_core("auto", config) == "thread"
    assert resolve_engine_core("process", config) == "process"
    assert resolve_engine_core("thread", config) == "thread"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_is_the_process_on_cuda():
    assert resolve_engine_core("auto", EngineConfig.from_kwargs(device="cuda")) == "process"


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="engine core must be one of auto, thread, process"):
        resolve_engine_core("fiber", EngineConfig.from_kwargs(device="cpu"))
