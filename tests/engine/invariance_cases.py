"""Row invariance of the GPU kernels a verify step shares with a decode step: a row's result is
bitwise the same whatever rows come with it. The checks themselves.

Run in-process on CUDA by test_row_invariance.py, and on the CPU as a script under Triton's
interpreter (`TRITON_INTERPRET=1 python -m tests.engine.invariance_cases linear`): the
interpreter must be chosen before triton is imported, so the CPU run needs a fresh process.
Each check has its negative control: the same comparison catches a product or a softmax summed
in other steps, so bitwise agreement is not something it grants anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import triton_backend
from engine.attention.metadata import build_attention_metadata
from engine.attention.torch_backend import paged_attention, write_kv
from engine.models import invariant_linear

# Row counts: decode and verify widths, a 17-row product over two row tiles, the widest the
# kernel takes. Weights (in, out): SmolLM2's qkv, an inner and outer size that do not fill a
# tile, and 128- and 64-column programs (fewer on the CPU, where the interpreter is slow).
ROW_COUNTS = [1, 2, 5, 16, 17, 64]
SHAPES = {"cuda": [(576, 960), (80, 48), (576, 6144), (576, 49152)],
          "cpu": [(192, 160), (80, 48)]}


def _randn(generator, device, dtype, *size):
    return torch.randn(*size, generator=generator).to(device, dtype)


def _first_rows_agree(product, x: torch.Tensor, others: torch.Tensor) -> bool:
    """Whether x's rows come out bitwise the same alone and with every count of other rows."""
    alone = product(x)
    return all(torch.equal(product(torch.cat([x, others[:count - len(x)]]))[:len(x)], alone)
               for count in ROW_COUNTS if count > len(x))


def check_linear(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    generator = torch.Generator().manual_seed(0)
    for in_features, out_features in SHAPES[device.type]:
        weight = _randn(generator, device, dtype, out_features, in_features) / in_features ** 0.5
        bias = _randn(generator, device, dtype, out_features)
        x = _randn(generator, device, dtype, max(ROW_COUNTS), in_features)
        residual = _randn(generator, device, dtype, max(ROW_COUNTS), out_features)
        for rows in ROW_COUNTS:
            got = invariant_linear.linear(x[:rows], weight, bias, residual[:rows])
            want = F.linear(x[:rows].float(), weight.float(), bias.float()) + residual[:rows]
            torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
        for first in (1, 3):
            assert _first_rows_agree(lambda rows: invariant_linear.linear(rows, weight),
                                     x[:first], x[first:])

        # negative control: with company, the product split in two halves of the inner
        # dimension whose partial results are summed in the output's precision (as a split-K
        # GEMM reducing in bfloat16 does)
        half = in_features // 2

        def split(rows):
            if len(rows) == 1:
                return invariant_linear.linear(rows, weight)
            return (invariant_linear.linear(rows[:, :half].contiguous(),
                                            weight[:, :half].contiguous())
                    + invariant_linear.linear(rows[:, half:].contiguous(),
                                              weight[:, half:].contiguous()))

        assert not _first_rows_agree(split, x[:1], x[1:])


def _attend(q, k_cache, v_cache, position: int, num_rows: int, table, block_size):
    """Rows position .. position + num_rows - 1 of one request, its KV already cached."""
    meta = build_attention_metadata([num_rows], [position + num_rows], [table], block_size,
                                    q.device)
    rows = q[position:position + num_rows]
    return paged_attention(rows, None, None, k_cache, v_cache, meta, "triton", kv_written=True)


def check_attention(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    """A verified position attends bitwise as a decoded one, for queries of 1 to 16 rows (one
    program, then several): SmolLM2's 9 query heads on 3 KV heads, GQA 4 on 2."""
    generator = torch.Generator().manual_seed(1)
    block_size, context = 16, 90
    for heads, kv_heads, head_dim in [(9, 3, 64), (8, 2, 32)]:
        q = _randn(generator, device, dtype, context, heads, head_dim)
        k = _randn(generator, device, dtype, context, kv_heads, head_dim)
        v = _randn(generator, device, dtype, context, kv_heads, head_dim)
        num_blocks = -(-context // block_size)
        table = torch.randperm(num_blocks + 2, generator=generator)[:num_blocks].tolist()
        k_cache = torch.zeros(num_blocks + 2, block_size, kv_heads, head_dim, dtype=dtype,
                              device=device)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(context)], device=device)
        write_kv(k, v, k_cache, v_cache, slots)

        def attend(position, num_rows):
            return _attend(q, k_cache, v_cache, position, num_rows, table, block_size)

        start = 60
        decoded = torch.cat([attend(start + i, 1) for i in range(16)])
        for num_rows in (2, 5, 6, 16):
            assert torch.equal(attend(start, num_rows), decoded[:num_rows]), (heads, num_rows)
        # against the torch backend, within rounding
        meta = build_attention_metadata([16], [start + 16], [table], block_size, device)
        want = paged_attention(q[start:start + 16], None, None, k_cache, v_cache, meta, "torch",
                               kv_written=True)
        torch.testing.assert_close(decoded, want, atol=tolerance, rtol=tolerance)
        # negative control: the softmax walked in 16-key steps sums in another order
        keys_per_step = triton_backend.KEYS_PER_STEP
        triton_backend.KEYS_PER_STEP = block_size
        try:
            assert not torch.equal(attend(start, 16), decoded)
        finally:
            triton_backend.KEYS_PER_STEP = keys_per_step


CHECKS = {"linear": check_linear, "attention": check_attention}

if __name__ == "__main__":
    from tests.engine.interpreted import main

    main(CHECKS)
