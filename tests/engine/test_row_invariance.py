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


def test_the_kernel_takes_steps_of_at_most_64_rows_on_the_gpu(monkeypatch):
    from engine.models import invariant_linear

    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not invariant_linear.applies(torch.zeros(2, 4, dtype=torch.bfloat16), weight)  # CPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert invariant_linear.applies(torch.zeros(2, 4, dtype=torch.bfloat16), weight)
    assert invariant_linear.applies(torch.zeros(64, 4, dtype=torch.bfloat16), weight)
    assert invariant_linear.applies(torch.zeros(2, 4), weight.float())
    assert not invariant_linear.applies(torch.zeros(65, 4, dtype=torch.bfloat16), weight)
    assert not invariant_linear.applies(torch.zeros(2, 2, 4, dtype=torch.bfloat16), weight)
    assert not invariant_linear.applies(torch.zeros(2, 4, dtype=torch.long), weight.long())


def test_batch_invariance_is_refused_where_it_cannot_hold(tiny_chat_model_folder):
    """The CPU's float32 kernels are row-invariant already (the lossless tests check it), so
    --batch-invariant is taken there as it is; its bfloat16 products are not: refused."""
    from tests.conftest import make_llm

    with pytest.raises(ValueError, match="--batch-invariant on CPU needs --dtype float32"):
        make_llm(str(tiny_chat_model_folder), device="cpu", dtype="bfloat16",
                 batch_invariant=True, speculative_method="none")
    with pytest.raises(ValueError, match="--batch-invariant takes at most 15 speculative"):
        make_llm(str(tiny_chat_model_folder), device="cpu", batch_invariant=True,
                 speculative_method="suffix", num_speculative_tokens=16)
    llm = make_llm(str(tiny_chat_model_folder), device="cpu", batch_invariant=True,
                   speculative_method="none")
    assert not any(getattr(m, "row_invariant", False) for m in llm.engine.runner.model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batch_invariance_on_a_gpu_needs_the_triton_attention(tiny_chat_model_folder):
    from tests.conftest import make_llm

    with pytest.raises(ValueError, match="--batch-invariant needs --attention-backend triton"):
        make_llm(str(tiny_chat_model_folder), device="cuda", batch_invariant=True,
                 attention_backend="torch", speculative_method="none")
    llm = make_llm(str(tiny_chat_model_folder), device="cuda", batch_invariant=True,
                   speculative_method="none")
    assert llm.engine.runner.model.lm_head.row_invariant


def test_columns_per_program_follow_the_weight_alone():
    from engine.models.invariant_linear import block_columns

    # SmolLM2's products: o and down (576), qkv (960), gate/up (3072), the LM head (49152)
    assert [block_columns(n) for n in (48, 576, 960, 3072, 49152)] == [16, 16, 16, 32, 128]



def _placement_free(dot, a) -> bool:
    """Whether row 3 of `a` comes out of `dot` bitwise the same alone and at rows 0, 5 and 15."""
    import numpy as np

    alone = dot(a[3:4])[0]
    for place in (0, 5, 15):
        rows = a.copy()
        rows[place] = a[3]
        if not np.array_equal(dot(rows)[place], alone):
            return False
    return True


def test_the_interpreters_dot_gives_a_row_the_same_product_wherever_it_sits(monkeypatch):
    """The interpreted checks' `tl.dot` (interpreted.fixed_order_dot): a row's product is bitwise
    the same alone and at any place among other rows, and equals float64's within rounding.
    Negative control: a product whose rows after the first sum K in two halves fails the check."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.engine.interpreted import fixed_order_dot

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        interpreter.InterpreterBuilder.create_dot)
    fixed_order_dot()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)

    def dot(rows, weight=b):
        handles = [interpreter.TensorHandle(x, tl.float32)
                   for x in (rows, weight, np.zeros((len(rows), 64), np.float32))]
        return interpreter.InterpreterBuilder.create_dot(None, *handles, "ieee", 0).data

    def split_after_first(rows):
        out = dot(rows)
        out[1:] = dot(rows[1:, :32].copy(), b[:32]) + dot(rows[1:, 32:].copy(), b[32:])
        return out

    assert _placement_free(dot, a)
    np.testing.assert_allclose(dot(a[3:4])[0], a[3].astype(np.float64) @ b, rtol=1e-4,
                               atol=1e-4)
    assert not _placement_free(split_after_first, a)
