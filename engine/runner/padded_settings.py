"""Whether an engine takes padded steps (static_runner.py), and the environment knobs of their
start-up warm-up."""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig

# Tests only: batch buckets (comma-separated) that the start-up warm-up leaves out, so that a
# step of that size is met for the first time while serving (engine/metrics/first_use.py).
SKIP_WARM_ENV = "SPECSERVE_TEST_SKIP_WARM_BATCH"
# "1": padded steps where the configuration leaves them to the device (the server has no flag for
# them): how a CPU runs the GPU's step layout, its warm-up and first-use counts.
PADDED_STEPS_ENV = "SPECSERVE_PADDED_STEPS"


def uses_padded_steps(config: EngineConfig, device: torch.device) -> bool:
    """`padded_steps` as configured; by default on CUDA only (on CPU the flat batch is cheaper),
    unless $SPECSERVE_PADDED_STEPS is "1" or "0"."""
    padded = config.model.padded_steps
    if padded is not None:
        return padded
    setting = os.environ.get(PADDED_STEPS_ENV, "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"{PADDED_STEPS_ENV} must be 0 or 1, got {setting!r}")
    return device.type == "cuda" if not setting else setting == "1"


def skipped_warm_batches() -> set[int]:
    """$SPECSERVE_TEST_SKIP_WARM_BATCH's batch buckets (tests only)."""
    setting = os.environ.get(SKIP_WARM_ENV, "")
    try:
        return {int(part) for part in setting.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"{SKIP_WARM_ENV} must list batch sizes, got {setting!r}") from None
