"""Row invariance of the GPU kernels (engine/models/invariant_linear.py and the Triton attention
kernel): natively on CUDA, under Triton's interpreter on the CPU (a fresh process, as the
interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.interpreted import run_check

pytest.importorskip("triton")


def test_a_rows_product_does_not_depend_on_the_other_rows():
    run_check("tests.engine.invariance_cases", "linear")


def test_a_verified_row_attends_as_a_decoded_one():
    run_check("tests.engine.invariance_cases", "attention")


def test_the_kernel_takes_half_precision_steps_of_at_most_64_rows(monkeypatch):
    from engine.models import invariant_linear

    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not invariant_linear.applies(torch.zeros(2, 4, dtype=torch.bfloat16), weight)  # CPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert invariant_linear.applies(torch.zeros(2, 4, dtype=torch.bfloat16), weight)
    assert invariant_linear.applies(torch.zeros(64, 4, dtype=torch.bfloat16), weight)
    assert not invariant_linear.applies(torch.zeros(65, 4, dtype=torch.bfloat16), weight)
    assert not invariant_linear.applies(torch.zeros(2, 4), weight.float())  # float32: cuBLAS
    assert not invariant_linear.applies(torch.zeros(2, 2, 4, dtype=torch.bfloat16), weight)
    monkeypatch.setenv("SPECSERVE_DISABLE_INVARIANT_LINEAR", "1")
    invariant_linear._enabled.cache_clear()
    try:
        assert not invariant_linear.applies(torch.zeros(2, 4, dtype=torch.bfloat16), weight)
    finally:
        monkeypatch.delenv("SPECSERVE_DISABLE_INVARIANT_LINEAR")
        invariant_linear._enabled.cache_clear()


def test_columns_per_program_follow_the_weight_alone():
    from engine.models.invariant_linear import block_columns

    # SmolLM2's products: o and down (576), qkv (960), gate/up (3072), the LM head (49152)
    assert [block_columns(n) for n in (48, 576, 960, 3072, 49152)] == [16, 16, 16, 32, 128]
