"""GGUF block formats and the compiled weight-only kernel: every type, the compiled instruction
sets this CPU runs and the pure-torch fallback all equal dequantize(W) @ x.

Blocks are random bytes (any bit pattern is a valid block) with small finite fp16 scales, so
every nibble, sign and 6-bit scale combination occurs. The format reference is the `gguf`
package's own dequantizer, an implementation independent of ours.
"""

from __future__ import annotations

import os

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from engine.quant import formats, int8
from engine.quant.formats import FORMATS
from engine.quant.gguf_weight import GGUFWeight, PackedTensor
from engine.quant.kernels import ISA_AVX2, ISA_AVX512, ISA_GENERIC, load_kernel

# Byte offsets of each format's fp16 scale fields inside a block.
ROWS = [1, 2, 7, 64]  # activation rows: decode, small batches, a verify step, a large batch
# GGUF's own block types; the integer path's repacked groups have their own tests
# (tests/engine/test_int8_kernels.py).
TYPES = sorted((f for f in FORMATS.values() if f.ggml_type not in int8.ORIGINAL),
               key=lambda f: f.ggml_type)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64: the kernels' accuracy measure."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def compiled_isas() -> list[int]:
    kernel = load_kernel()
    return [isa for isa in (ISA_GENERIC, ISA_AVX2, ISA_AVX512) if isa <= kernel.best_isa()]


@pytest.fixture(scope="module")
def kernel():
    module = load_kernel()
    if module is None:
        if os.environ.get("SPECSERVE_DISABLE_GGUF_KERNEL") == "1":
            pytest.skip("kernel disabled by SPECSERVE_DISABLE_GGUF_KERNEL=1")
        pytest.fail("the GGUF CPU kernel did not build (make install builds it)")
    return module


def shape_for(fmt: formats.BlockFormat) -> tuple[int, int]:
    """Odd shapes: an odd number of output rows (not a multiple of any tile) and of blocks."""
    return 37, fmt.block_size * 3


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_dequantize_matches_the_gguf_package(fmt):
    rows, in_features = shape_for(fmt)
    packed = formats.random_blocks(fmt, rows, in_features)
    reference = gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    expected = torch.from_numpy(np.asarray(reference, dtype=np.float32)).reshape(rows, in_features)
    torch.testing.assert_close(formats.dequantize(packed, fmt.ggml_type, in_features), expected,
                               rtol=0, atol=0)


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_kernel_dequantize_is_exact(kernel, fmt):
    rows, in_features = shape_for(fmt)
    packed = formats.random_blocks(fmt, rows, in_features, seed=1)
    expected = formats.dequantize(packed, fmt.ggml_type, in_features)
    for isa in compiled_isas():
        actual = kernel.dequantize(packed, fmt.ggml_type, in_features, isa)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_kernel_matmul_equals_dequantized_product(kernel, fmt, num_rows):
    out_features, in_features = shape_for(fmt)
    packed = formats.random_blocks(fmt, out_features, in_features, seed=2)
    weight = formats.dequantize(packed, fmt.ggml_type, in_features)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(3))
    expected = x.double() @ weight.double().t()
    for isa in compiled_isas():
        out = torch.full((num_rows, out_features), float("nan"))
        kernel.matmul_out(x, packed, fmt.ggml_type, out, isa)
        assert relative_error(out, expected) <= 1e-5, (fmt.name, num_rows, isa)


@pytest.mark.parametrize("num_rows", [3, 64], ids=["row-kernel", "dequantize-then-gemm"])
def test_kernel_writes_into_a_column_slice_and_nowhere_else(kernel, num_rows):
    fmt = formats.FORMATS_BY_NAME["Q4_1"]
    packed = formats.random_blocks(fmt, 9, 64)
    x = torch.randn(num_rows, 64)
    out = torch.zeros(num_rows, 20)
    kernel.matmul_out(x, packed, fmt.ggml_type, out.narrow(1, 5, 9))
    expected = x.double() @ formats.dequantize(packed, fmt.ggml_type, 64).double().t()
    assert relative_error(out[:, 5:14], expected) <= 1e-5
    assert out[:, :5].eq(0).all() and out[:, 14:].eq(0).all()


def test_kernel_rejects_mismatched_shapes(kernel):
    fmt = formats.FORMATS_BY_NAME["Q8_0"]
    packed = formats.random_blocks(fmt, 4, 64)
    with pytest.raises(RuntimeError, match="expected"):
        kernel.matmul_out(torch.randn(1, 96), packed, fmt.ggml_type, torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="no CPU kernel"):
        kernel.dequantize(packed, 6, 64)  # Q5_0: no kernel


@pytest.fixture(params=[True, False], ids=["kernel", "torch-fallback"])
def weight_path(request, monkeypatch):
    """GGUFWeight on the compiled kernel, and again on the pure-torch fallback."""
    if not request.param:
        monkeypatch.setattr("engine.quant.gguf_weight.load_kernel", lambda: None)


def single_format_weight(name: str, rows: int, in_features: int):
    """A GGUFWeight of one part of random blocks, with the packed blocks and their format."""
    fmt = formats.FORMATS_BY_NAME[name]
    packed = formats.random_blocks(fmt, rows, in_features)
    weight = GGUFWeight(rows, in_features)
    weight.add(PackedTensor(packed, fmt.ggml_type, (rows, in_features)), 0)
    return weight, packed, fmt


def test_weight_fused_from_parts_of_different_formats(weight_path):
    """q (Q4_K), k (Q4_K) and v (Q6_K) as one projection, as a Q4_K_M file stores them; the
    fallback path dequantizes in torch and must give the same product."""
    in_features = 512
    parts = [("Q4_K", 0, 24), ("Q4_K", 24, 8), ("Q6_K", 32, 8)]
    weight = GGUFWeight(40, in_features)
    dense = torch.empty(40, in_features)
    for seed, (name, offset, rows) in enumerate(parts):
        fmt = formats.FORMATS_BY_NAME[name]
        packed = formats.random_blocks(fmt, rows, in_features, seed=seed)
        weight.add(PackedTensor(packed, fmt.ggml_type, (rows, in_features)), offset)
        dense[offset:offset + rows] = formats.dequantize(packed, fmt.ggml_type, in_features)
    assert weight.complete and weight.format_names == ["Q4_K", "Q6_K"]  # q and k merged
    for num_rows in ROWS:
        x = torch.randn(num_rows, in_features)
        assert relative_error(weight.matmul(x), x.double() @ dense.double().t()) <= 1e-5
    ids = torch.tensor([3, 0, 3])
    with pytest.raises(ValueError, match="one block format"):
        weight.rows(ids)


def test_row_lookup_of_a_packed_vocabulary(weight_path):
    weight, packed, fmt = single_format_weight("Q8_0", 50, 64)
    ids = torch.tensor([7, 0, 49, 7])
    expected = formats.dequantize(packed, fmt.ggml_type, 64)[ids]
    torch.testing.assert_close(weight.rows(ids), expected, rtol=0, atol=0)


def test_block_format_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        formats.FORMATS_BY_NAME["Q4_K"].row_bytes(300)


def test_single_format_weight_keeps_leading_dimensions(weight_path):
    weight, packed, fmt = single_format_weight("Q4_0", 30, 96)
    x = torch.randn(2, 3, 96)
    expected = x.double() @ formats.dequantize(packed, fmt.ggml_type, 96).double().t()
    out = weight.matmul(x)
    assert out.shape == (2, 3, 30)
    assert relative_error(out, expected) <= 1e-5


def test_q8_0_quantization_is_ggmls_byte_for_byte():
    """Float weights to Q8_0 (draft heads beside an integer-kernel target): the same bytes as
    the gguf package's port of ggml's reference quantizer, zero blocks and ties included."""
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[3, :32] = 0.0  # a zero block: scale 0, every value 0
    # max |w| = 127 makes d = 1, so w / d = k + 0.5 are exact ties: rounded away from zero
    weight[4, :32] = torch.cat([torch.tensor([127.0]), torch.arange(31) - 15 + 0.5])
    ours = formats.quantize_q8_0(weight)
    theirs = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == (32, FORMATS[8].row_bytes(256))
    assert np.array_equal(ours.numpy(), theirs)
    assert ours[4, 3:34].view(torch.int8).tolist() == [
        int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in (np.arange(31) - 15 + 0.5)]
    # The control: rounding half to even (torch.round) gives other bytes on the tie block.
    assert not torch.equal(weight[4, 1:32].round().to(torch.int8), ours[4, 3:34].view(torch.int8))


def test_a_refused_call_raises_cleanly_or_the_kernel_is_not_used(kernel, monkeypatch, caplog):
    """The built kernel raises a RuntimeError naming the refused value (checked in a child
    process). Controls: probes that crash, truncate the message or do not raise are each
    reported, and a kernel so reported is not used."""
    from engine.quant import kernels

    assert kernels.error_path_failure(kernels.build_dir()) is None
    crash = "import os\nos.abort()"
    assert "crashed the process" in kernels.error_path_failure(kernels.build_dir(), crash)
    assert "without naming" in kernels.error_path_failure(kernels.build_dir(), "exit(3)")
    assert "did not raise" in kernels.error_path_failure(kernels.build_dir(), "exit(4)")
    monkeypatch.setattr(kernels, "error_path_failure", lambda folder: "crashed the process")
    assert kernels.load_kernel.__wrapped__() is None
    assert "pure-torch fallback" in caplog.text
