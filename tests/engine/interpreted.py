"""Triton kernels' checks on the CPU, under Triton's interpreter: the interpreter must be chosen
before triton is imported, so each check runs as a fresh process of a `*_cases` module."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tests.conftest import TEST_DEVICE

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"cuda": (torch.float32, torch.bfloat16), "cpu": (torch.float32,)}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def run_check(module: str, check: str, *args: str) -> None:
    """`module.CHECKS[check]` on TEST_DEVICE: in this process on CUDA, else in a fresh process
    under Triton's interpreter (`main` below)."""
    if TEST_DEVICE.type == "cuda":
        run_on(importlib.import_module(module).CHECKS[check], TEST_DEVICE, *args)
    else:
        run_interpreted(module, check, *args)


def run_on(check: Callable[..., None], device: torch.device, *args: str) -> None:
    """A check on `device`; kernel checks (those taking a dtype) in float32, and on CUDA in
    bfloat16 too, each within its tolerance."""
    if "dtype" in inspect.signature(check).parameters:
        for dtype in DTYPES[device.type]:
            check(device, dtype, TOLERANCE[dtype])
    else:
        check(device, *args)


def run_interpreted(module: str, *args: str) -> None:
    """Runs `python -m module args...` with TRITON_INTERPRET=1; it must print "ok" last."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def fixed_order_dot() -> None:
    """Makes the interpreter's float32 `tl.dot` sum each output's products in one fixed order.

    The interpreter computes `tl.dot` with numpy's matmul, and numpy's OpenBLAS gives a row a
    result that depends on where the row sits in the matrix and what comes with it on AVX2-only
    CPUs (its Haswell and Zen kernels; 168 of 256 row placements differed on a 16x64 by 64x64
    product, OpenBLAS 0.3.31), though not with its AVX-512 kernels. A GPU's matrix instruction
    reduces an output over K in the same order whatever the other rows hold, and that is what
    the kernels' row-invariance checks assume of `tl.dot`; here each output's K products are
    summed in an order that depends on K alone, so the checks test the kernels' own reduction
    order on every CPU."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data[..., :, :, None] * b.data[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def main(checks: dict[str, Callable[..., None]]) -> None:
    """A cases module's entry: runs checks[argv[1]] with argv[2:] on the CPU, on the torch path
    CUDA runs (the CPU extension's fused ops off), with a fixed-order `tl.dot`, then prints
    "ok"."""
    import engine.quant.kernels as kernels

    kernels.load_kernel = lambda: None
    fixed_order_dot()
    run_on(checks[sys.argv[1]], torch.device("cpu"), *sys.argv[2:])
    print("ok")
