"""Triton kernels' checks on the CPU, under Triton's interpreter: the interpreter must be chosen
before triton is imported, so each check runs as a fresh process of a `*_cases` module."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: str) -> None:
    """Runs `python -m module args...` with TRITON_INTERPRET=1; it must print "ok" last."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def main(checks: dict[str, Callable[..., None]]) -> None:
    """A cases module's entry: runs checks[argv[1]](*argv[2:]) on the torch path CUDA runs (the
    CPU extension's fused ops off), then prints "ok"."""
    import engine.quant.kernels as kernels

    kernels.load_kernel = lambda: None
    checks[sys.argv[1]](*sys.argv[2:])
    print("ok")
