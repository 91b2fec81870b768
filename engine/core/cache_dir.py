"""Where specserve keeps what it makes once per machine: dequantized models, compiled kernels,
calibrations. Imports nothing of the engine, so low-level modules (the kernel builder) can use it
without importing the model loader."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$SPECSERVE_CACHE_DIR, else ~/.cache/specserve (a temp folder where there is no home)."""
    if os.environ.get("SPECSERVE_CACHE_DIR"):
        return Path(os.environ["SPECSERVE_CACHE_DIR"])
    try:
        return Path.home() / ".cache" / "specserve"
    except RuntimeError:
        return Path(tempfile.gettempdir()) / "specserve-cache"


TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def use_triton_cache_dir() -> str:
    """Points Triton's compiled-kernel cache at `cache_dir()/triton` unless the user chose one
    ($TRITON_CACHE_DIR); returns the folder in use. Triton reads the variable when it first
    compiles, so this runs before any kernel is built. Keeping the kernels with specserve's other
    per-machine products means one mounted volume (a container's SPECSERVE_CACHE_DIR) makes a
    restart skip every compile, where Triton's default (~/.triton) lives in the container."""
    if not os.environ.get(TRITON_CACHE_ENV):
        os.environ[TRITON_CACHE_ENV] = str(cache_dir() / "triton")
    return os.environ[TRITON_CACHE_ENV]
