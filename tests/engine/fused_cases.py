"""The fused skinny GEMMs (engine/models/skinny_gemm.py) against the torch path: the checks.

Run in-process on CUDA by test_fused_kernels.py, and on the CPU as a script under Triton's
interpreter (`TRITON_INTERPRET=1 python -m tests.engine.fused_cases ops`): the interpreter must
be chosen before triton is imported, so the CPU run needs a fresh process. Shapes are tiny on the
CPU (the interpreter runs a program at a time in numpy); on CUDA the default model's are added.
Every check has a negative control that the same comparison must catch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.torch_backend import write_kv
from engine.models import skinny_gemm
from engine.models.layers import RotaryStep
from engine.models.skinny_tiles import Tiles, tiles_for

# (hidden, heads, kv heads, head dim, intermediate): half a head of one tile and of two, an
# inner size that leaves the last chunk partly masked; SmolLM2's on CUDA.
SHAPES = {"cpu": [(64, 2, 1, 32, 48), (80, 2, 1, 64, 40)],
          "cuda": [(64, 2, 1, 32, 48), (80, 2, 1, 64, 40), (576, 9, 3, 64, 1536)]}
ROW_COUNTS = {"cpu": [1, 2, 5, 16, 17], "cuda": [1, 2, 5, 16, 17, 64]}


def _randn(generator, device, dtype, *size, scale=1.0):
    return (torch.randn(*size, generator=generator) * scale).to(device, dtype)


class Case:
    """One layer's worth of random weights, activations and a rotation for `rows` rows."""

    def __init__(self, shape, rows, device, dtype, seed=0):
        hidden, self.heads, self.kv_heads, self.head_dim, size = shape
        g = torch.Generator().manual_seed(seed)
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.x = _randn(g, device, dtype, rows, hidden)
        self.residual = _randn(g, device, dtype, rows, hidden)
        self.norm = _randn(g, device, dtype, hidden, scale=0.1) + 1
        self.eps = 1e-5
        self.qkv = _randn(g, device, dtype, width, hidden, scale=hidden ** -0.5)
        self.gate_up = _randn(g, device, dtype, 2 * size, hidden, scale=hidden ** -0.5)
        self.o = _randn(g, device, dtype, hidden, hidden, scale=hidden ** -0.5)
        positions = torch.arange(rows) + 5  # not 0, where sin is 0 and a wrong sin unseen
        angles = positions[:, None] * 3.0 * torch.linspace(0.01, 1.0, self.head_dim)
        half = self.head_dim // 2
        self.cos = angles.cos().to(device, dtype)[:, None]
        sin = angles.sin().to(device, dtype)[:, None]
        self.sin_rolled = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        self.sin = sin
        blocks, block_size = 8, 16
        self.slots = torch.randperm(blocks * block_size, generator=g)[:rows].to(device)
        self.cache_shape = (blocks, block_size, self.kv_heads, self.head_dim)

    def caches(self):
        k_cache = torch.zeros(self.cache_shape, dtype=self.x.dtype, device=self.x.device)
        return k_cache, torch.zeros_like(k_cache)

    def fused_qkv(self, x=None, tiles=None, sin=None):
        k_cache, v_cache = self.caches()
        x = self.x if x is None else x
        out = skinny_gemm.norm_qkv_rope(
            x, self.norm, self.eps, self.qkv, self.cos[:len(x)],
            (self.sin_rolled if sin is None else sin)[:len(x)], self.heads, k_cache, v_cache,
            self.slots[:len(x)], tiles)
        return out, k_cache, v_cache

    def torch_qkv(self):
        """The torch path's: RMSNorm, the product, RotaryStep.rotate, write_kv."""
        k_cache, v_cache = self.caches()
        y = F.linear(F.rms_norm(self.x, (self.x.shape[1],), self.norm, self.eps), self.qkv)
        heads = self.heads + self.kv_heads
        qk = y[:, :heads * self.head_dim].reshape(len(y), heads, self.head_dim)
        v = y[:, heads * self.head_dim:].reshape(len(y), self.kv_heads, self.head_dim)
        qk = RotaryStep(None, self.cos, self.sin_rolled, None).rotate(qk, self.heads)
        write_kv(qk[:, self.heads:], v, k_cache, v_cache, self.slots)
        return torch.cat([qk.flatten(1), v.flatten(1)], dim=1), k_cache, v_cache

    def torch_gate_up(self, gate_up=None):
        y = F.linear(F.rms_norm(self.x, (self.x.shape[1],), self.norm, self.eps),
                     self.gate_up if gate_up is None else gate_up)
        gate, up = y.float().chunk(2, dim=-1)
        return F.silu(gate) * up


def _close(got, want, tolerance) -> bool:
    return torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def check_ops(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    """Each fused op within the dtype's tolerance of the torch path, at 1 to 17 rows; the
    controls (a missing residual, a transposed weight, gate and up swapped, sin not negated)
    fail the same comparison."""
    for shape in SHAPES[device.type]:
        for rows in (1, 5, 17):
            case = Case(shape, rows, device, dtype, seed=rows)
            want = F.linear(case.x.float(), case.o.float()) + case.residual.float()
            got = skinny_gemm.linear(case.x, case.o, case.residual)
            assert _close(got, want, tolerance), (shape, rows, "linear")
            assert not _close(skinny_gemm.linear(case.x, case.o), want, tolerance)
            assert not _close(skinny_gemm.linear(case.x, case.o.t().contiguous(),
                                                 case.residual), want, tolerance)

            got = skinny_gemm.norm_gate_up_silu(case.x, case.norm, case.eps, case.gate_up)
            assert _close(got, case.torch_gate_up(), tolerance), (shape, rows, "gate_up")
            swapped = torch.cat(case.gate_up.chunk(2)[::-1])
            assert not _close(got, case.torch_gate_up(swapped), tolerance)

            wanted = case.torch_qkv()
            for got, want in zip(case.fused_qkv(), wanted):
                assert _close(got, want, tolerance), (shape, rows, "qkv")
            plain_sin = case.fused_qkv(sin=case.sin)
            assert not _close(plain_sin[0], wanted[0], tolerance)
            assert not _close(plain_sin[1], wanted[1], tolerance)


def _alone_equals_in_company(product, x: torch.Tensor, counts) -> bool:
    """Whether x's first row comes out bitwise the same alone and with each count of rows."""
    alone = product(x[:1])
    return all(torch.equal(product(x[:count])[:1], alone) for count in counts if count > 1)


def check_row_invariance(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    """A row's result is bitwise the same alone and among 2 to 64 rows, for each fused op.
    Negative controls that fail the same comparison: a product split in two halves of the inner
    dimension, summed in the output's dtype, once a row has company (a split-K GEMM's way); and
    in float32, tiles that follow the row count (the inner dimension summed in other chunks once
    a row has company: a float32 difference, which rounding to bfloat16 mostly hides)."""
    counts = ROW_COUNTS[device.type]
    for shape in SHAPES[device.type][:2]:
        case = Case(shape, max(counts), device, dtype)

        def ops(tiles_of):
            return {
                "linear": lambda x: skinny_gemm.linear(
                    x, case.o, case.residual[:len(x)], tiles_of("linear", case.o, len(x))),
                "gate_up": lambda x: skinny_gemm.norm_gate_up_silu(
                    x, case.norm, case.eps, case.gate_up,
                    tiles_of("gate_up", case.gate_up, len(x))),
                "qkv": lambda x: case.fused_qkv(x, tiles_of("qkv", case.qkv, len(x)))[0],
            }

        def by_shape(kind, weight, rows):
            return tiles_for(kind, weight.shape[0] // (1 if kind == "linear" else 2),
                             weight.shape[1], case.head_dim // 2)

        def by_rows(kind, weight, rows):
            fixed = by_shape(kind, weight, rows)
            return fixed if rows == 1 else Tiles(fixed.block_n, fixed.block_k // 2)

        for name, product in ops(by_shape).items():
            assert _alone_equals_in_company(product, case.x, counts), (shape, name)
        half = case.x.shape[1] // 2

        def split(x):
            if len(x) == 1:
                return skinny_gemm.linear(x, case.o, case.residual[:1])
            return (skinny_gemm.linear(x[:, :half], case.o[:, :half].contiguous())
                    + skinny_gemm.linear(x[:, half:], case.o[:, half:].contiguous(),
                                         case.residual[:len(x)]))

        assert not _alone_equals_in_company(split, case.x, counts), shape
        if dtype == torch.float32:
            for name, product in ops(by_rows).items():
                assert not _alone_equals_in_company(product, case.x, counts), (shape, name)


CHECKS = {"ops": check_ops, "invariance": check_row_invariance}

if __name__ == "__main__":
    from tests.engine.interpreted import main

    main(CHECKS)
