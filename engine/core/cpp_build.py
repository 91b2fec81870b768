"""Builds a C++ extension with torch.utils.cpp_extension into specserve's cache folder: kept
there between runs and rebuilt only when a source changes. Shared by the CPU kernels
(engine/quant/kernels.py) and the suffix trie (engine/spec_decode/suffix_native.py).

A build leaves a stamp beside the library: the hash of everything that went into it (the
folder's sources and headers, the flags, torch's and Python's versions). Where the stamp
matches, the library is loaded directly: torch.utils.cpp_extension imports setuptools on the way
(~4 MB of a server's resident memory) and runs ninja to check what is current, for a file that is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from engine.core.cache_dir import cache_dir

STAMP_FILE = "inputs.sha256"


def extension_dir(name: str) -> Path:
    return cache_dir() / "extensions" / name


def build_extension(name: str, sources: list[Path], include_dir: Path, cflags: list[str],
                    ldflags: list[str] = (), verbose: bool = False):
    """The loaded module; raises where it cannot be built (no compiler, no ninja)."""
    folder = extension_dir(name)
    library, stamp = folder / f"{name}.so", _inputs_hash(name, sources, include_dir, cflags,
                                                         ldflags)
    if library.is_file() and _read(folder / STAMP_FILE) == stamp:
        return sys.modules.get(name) or _load_library(name, library)
    module = _build(name, sources, include_dir, cflags, ldflags, verbose, folder)
    staging = folder / f".{STAMP_FILE}.{os.getpid()}"
    staging.write_text(stamp)
    os.replace(staging, folder / STAMP_FILE)  # whole or absent, for a process starting meanwhile
    return module


def _build(name, sources, include_dir, cflags, ldflags, verbose, folder: Path):
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; the `ninja` wheel installs it next to this interpreter, which
    # is not on PATH when a venv's python is run without activating the venv.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    folder.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source) for source in sources],
                extra_include_paths=[str(include_dir)], extra_cflags=list(cflags),
                extra_ldflags=list(ldflags), build_directory=str(folder), verbose=verbose)


def _inputs_hash(name: str, sources: list[Path], include_dir: Path, cflags, ldflags) -> str:
    import torch

    digest = hashlib.sha256(repr((name, torch.__version__, sys.version, list(cflags),
                                  list(ldflags))).encode())
    files = sorted({*map(Path, sources), *include_dir.glob("*.h"), *include_dir.glob("*.hpp"),
                    *include_dir.glob("*.cpp")})
    for path in files:
        digest.update(f"{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _load_library(name: str, library: Path):
    """The built library as a module, as torch.utils.cpp_extension loads it (torch is imported
    already, by _inputs_hash: the library links against it)."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
