"""The fused Triton decoder ops (engine/models/triton_ops.py) against the torch path: natively
on CUDA, under Triton's interpreter on the CPU (a fresh process, as the interpreter must be
chosen before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.interpreted import run_check

pytest.importorskip("triton")


def test_fused_ops_match_the_torch_path():
    run_check("tests.engine.triton_ops_cases", "kernels")


def test_engine_with_fused_ops_gives_the_torch_paths_tokens(tiny_chat_model_folder):
    run_check("tests.engine.triton_ops_cases", "engine", str(tiny_chat_model_folder))


def test_ops_stay_off_where_they_do_not_apply(monkeypatch):
    from engine.models import triton_ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_ops.ops_for(torch.zeros(2)) is None  # a CPU tensor, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ops.ops_for(torch.zeros(2)) is triton_ops.TritonOps
    assert triton_ops.ops_for(torch.zeros(2, dtype=torch.long)) is None
    monkeypatch.setenv("SPECSERVE_DISABLE_TRITON_OPS", "1")
    assert triton_ops.ops_for(torch.zeros(2)) is None
