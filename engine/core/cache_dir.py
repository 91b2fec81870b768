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
