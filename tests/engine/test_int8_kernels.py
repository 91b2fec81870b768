"""The integer kernels (engine/quant/csrc/gguf_int8.cpp) against their torch reference
(engine/quant/int8.py): every variant this CPU runs gives bitwise the reference's result, for each
weight type, 1 to 64 activation rows, and each row's result is bitwise what it is alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.quant import formats, int8
from engine.quant.kernels import load_kernel

kernel = load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU kernel extension did not build")
VARIANTS = kernel.int8_cpu_isas() if kernel is not None else []  # every one this CPU runs
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 17, 20, 24, 64]  # every chunk size of every variant


def weights(ggml_type: int, rows: int = 48, in_features: int = 256, seed: int = 0):
    packed = formats.random_blocks(formats.FORMATS[ggml_type], rows, in_features, seed=seed)
    return packed, int8.repack(packed, ggml_type), int8.REPACKED[ggml_type]


def activations(rows: int, in_features: int = 256, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    return x


def kernel_matmul(x, repacked, int_type, isa=-1) -> torch.Tensor:
    out = torch.empty(x.shape[0], repacked.shape[0])
    kernel.int8_matmul_out(x, repacked, int_type, out, isa)
    return out


@pytest.mark.parametrize("ggml_type", sorted(int8.REPACKED))
def test_repacking_is_a_permutation_of_the_gguf_bytes(ggml_type):
    packed, repacked, int_type = weights(ggml_type)
    assert repacked.shape == packed.shape and not torch.equal(repacked, packed)
    assert torch.equal(int8.unpack(repacked, int_type), packed)
    ids = torch.tensor([47, 0, 16, 17, 0])
    assert torch.equal(int8.unpack_rows(repacked, int_type, ids), packed[ids])
    assert torch.equal(formats.dequantize(repacked, int_type, 256),
                       formats.dequantize(packed, ggml_type, 256))


@needs_kernel
@pytest.mark.parametrize("ggml_type", sorted(int8.REPACKED))
def test_compiled_row_unpacking_is_the_reference(ggml_type):
    """The embedding lookup's compiled unpacking gives the GGUF rows bitwise, in any order and
    with repeats; the control: the row after each asked one is different bytes."""
    packed, repacked, int_type = weights(ggml_type)
    ids = torch.tensor([[47, 0], [16, 17], [0, 31]])
    rows = kernel.int8_unpack_rows(repacked, int_type, ids)
    assert torch.equal(rows, packed[ids.reshape(-1)])
    assert torch.equal(rows, int8.unpack_rows(repacked, int_type, ids))
    assert not torch.equal(rows, packed[(ids.reshape(-1) + 1) % 48])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.int8_unpack_rows(repacked, int_type, torch.tensor([48]))


@needs_kernel
@pytest.mark.parametrize("isa", VARIANTS)
def test_activation_quantization_matches_the_reference(isa):
    x = activations(5) * 3
    x[1, 40] = 2.5 * x[1, 32:64].abs().max() / 127
    # A block whose max is 127 quantizes with inverse 1: exact ties at .5 round to even.
    x[2, 64:96] = torch.tensor([127.0, -127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5] * 4)
    for ours, reference in zip(kernel.int8_quantize_rows(x, isa), int8.quantize_rows(x)):
        assert torch.equal(ours, reference)
    q = kernel.int8_quantize_rows(x, isa)[0]
    assert q[2, 64:72].tolist() == [127, -127, 2, 4, -2, -4, 0, 0]


@needs_kernel
@pytest.mark.parametrize("ggml_type", sorted(int8.REPACKED))
@pytest.mark.parametrize("isa", VARIANTS)
def test_every_variant_is_bitwise_the_reference_and_row_invariant(ggml_type, isa):
    _, repacked, int_type = weights(ggml_type)
    x = activations(64)
    reference = int8.reference_matmul(x, repacked, int_type)
    for rows in ROW_COUNTS:
        assert torch.equal(kernel_matmul(x[:rows], repacked, int_type, isa), reference[:rows])
    alone = torch.cat([kernel_matmul(x[i:i + 1], repacked, int_type, isa) for i in range(64)])
    assert torch.equal(alone, reference)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernel_matmul(x[order], repacked, int_type, isa), reference[order])


@needs_kernel
@pytest.mark.parametrize("ggml_type", sorted(int8.REPACKED))
def test_the_integer_path_stays_close_to_float32_activations(ggml_type):
    packed, repacked, int_type = weights(ggml_type)
    x = activations(8)
    exact = x @ formats.dequantize(packed, ggml_type, 256).t()
    ours = kernel_matmul(x, repacked, int_type)
    assert float((ours - exact).norm() / exact.norm()) < 0.02


def test_bitwise_equality_is_not_order_blind():
    """Negative control: the same terms summed in another order (the scale-offset term first)
    differ from the canonical result in some bits, so the equality above checks the order."""
    _, repacked, int_type = weights(int8.Q4_1)
    x = activations(16)
    canonical = int8.reference_matmul(x, repacked, int_type)
    q, d_x, s_x, _ = int8.quantize_rows(x)
    values, d_w, m_w = int8._weight_fields(repacked, int_type, 256)
    isums = torch.matmul(q.reshape(16, -1, 32).double().transpose(0, 1),
                         values.permute(1, 2, 0)).float()
    reordered = torch.zeros_like(canonical)
    for b in range(values.shape[1]):
        reordered = reordered + m_w[:, b] * s_x[:, b, None]
        reordered = reordered + isums[b] * (d_w[:, b] * d_x[:, b, None])
    assert torch.allclose(reordered, canonical, atol=1e-4) and not torch.equal(reordered, canonical)


@needs_kernel
def test_an_environment_variable_forces_a_lower_variant():
    code = "from engine.quant.kernels import load_kernel; print(load_kernel().int8_isa())"
    run = lambda value: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "SPECSERVE_INT8_ISA": value})
    names = ["generic", "avx2", "avx-vnni", "avx512-vnni", "amx-int8"]
    for variant in VARIANTS:
        forced = run(names[variant])
        assert forced.returncode == 0 and forced.stdout.strip() == names[variant], forced.stderr
    missing = [name for i, name in enumerate(names) if i not in VARIANTS]
    if missing:  # a variant this CPU lacks is refused, not run
        refused = run(missing[0])
        assert refused.returncode != 0 and "not available on this CPU" in refused.stderr
    wrong = run("avx9000")
    assert wrong.returncode != 0 and "SPECSERVE_INT8_ISA must be" in wrong.stderr
