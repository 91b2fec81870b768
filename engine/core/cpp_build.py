"""Builds a C++ extension with torch.utils.cpp_extension into specserve's cache folder: kept
there between runs and rebuilt only when a source changes. Shared by the CPU kernels
(engine/quant/kernels.py) and the suffix trie (engine/spec_decode/suffix_native.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.core.cache_dir import cache_dir


def extension_dir(name: str) -> Path:
    return cache_dir() / "extensions" / name


def build_extension(name: str, sources: list[Path], include_dir: Path, cflags: list[str],
                    ldflags: list[str] = (), verbose: bool = False):
    """The loaded module; raises where it cannot be built (no compiler, no ninja)."""
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; the `ninja` wheel installs it next to this interpreter, which
    # is not on PATH when a venv's python is run without activating the venv.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    folder = extension_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source) for source in sources],
                extra_include_paths=[str(include_dir)], extra_cflags=list(cflags),
                extra_ldflags=list(ldflags), build_directory=str(folder), verbose=verbose)
