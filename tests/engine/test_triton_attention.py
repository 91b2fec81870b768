"""The Triton paged-attention backend (engine/attention/triton_backend.py) against the torch
backend: natively on CUDA, under Triton's interpreter on the CPU (a fresh process, as the
interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import sys

import pytest

from tests.engine.interpreted import run_check

pytest.importorskip("triton")


def test_kernel_matches_the_torch_backend():
    run_check("tests.engine.triton_attention_cases", "kernel")


def test_engine_with_the_triton_backend_gives_the_torch_backends_tokens(tiny_chat_model_folder):
    run_check("tests.engine.triton_attention_cases", "engine", str(tiny_chat_model_folder))


def test_missing_triton_is_a_one_line_error(monkeypatch):
    from engine.attention import triton_backend

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(ValueError, match="--attention-backend triton needs the triton package"):
        triton_backend.check_available()
