"""The fused Triton decoder ops (engine/models/triton_ops.py) against the torch path: natively
on CUDA, under Triton's interpreter on the CPU (a fresh process, as the interpreter must be
chosen before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TEST_DEVICE

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def _interpreted(*args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.engine.triton_ops_cases", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def test_fused_ops_match_the_torch_path():
    if TEST_DEVICE.type == "cuda":
        from tests.engine.triton_ops_cases import compare_kernels

        compare_kernels(TEST_DEVICE, torch.float32, tolerance=1e-5)
        compare_kernels(TEST_DEVICE, torch.bfloat16, tolerance=2e-2)
    else:
        _interpreted("kernels")


def test_engine_with_fused_ops_gives_the_torch_paths_tokens(tiny_chat_model_folder):
    if TEST_DEVICE.type == "cuda":
        from tests.engine.triton_ops_cases import compare_engine

        compare_engine(TEST_DEVICE, str(tiny_chat_model_folder))
    else:
        _interpreted("engine", str(tiny_chat_model_folder))


def test_ops_stay_off_where_they_do_not_apply(monkeypatch):
    from engine.models import triton_ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_ops.ops_for(torch.zeros(2)) is None  # a CPU tensor, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ops.ops_for(torch.zeros(2)) is triton_ops.TritonOps
    assert triton_ops.ops_for(torch.zeros(2, dtype=torch.long)) is None
    monkeypatch.setenv("SPECSERVE_DISABLE_TRITON_OPS", "1")
    assert triton_ops.ops_for(torch.zeros(2)) is None
