"""The fused Triton decoder ops (engine/models/triton_ops.py) against the torch path: the checks.

Run in-process on CUDA by test_triton_ops.py, and on the CPU as a script under Triton's
interpreter (`TRITON_INTERPRET=1 python -m tests.engine.triton_ops_cases kernels`): the
interpreter must be chosen before triton is imported, so the CPU run needs a fresh process.
"""

from __future__ import annotations

import os

import torch

from engine.attention.torch_backend import write_kv
from engine.models.layers import RotaryStep
from engine.models.triton_ops import TritonOps

# (heads, kv heads, head dim): SmolLM2's 9/3 x 64, plain multi-head, 8/2 x 128
SHAPES = [(9, 3, 64), (4, 4, 16), (8, 2, 128)]


def _rotation_case(shape, dtype, device, sin_table="rolled"):
    """(fused qk and caches, torch qk and caches) after rotating and storing 7 tokens."""
    heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    tokens, blocks, block_size = 7, 4, 16

    def randn(*size):
        return torch.randn(*size, generator=generator).to(device, dtype)
    # qk as the projection gives it: a view whose rows also hold v (stride past qk's width)
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 5, 17, 18, 40, 41, 63], device=device)
    angles = positions.float()[:, None] * torch.linspace(0.01, 1.0, dim, device=device)
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    half = dim // 2
    sin_rolled = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens].to(device)
    results = []
    for fused in (True, False):
        qk = qkv.clone()[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
        k_cache = torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        if fused:
            table = sin_rolled if sin_table == "rolled" else sin
            TritonOps.rotate_and_store(qk, v, cos, table, heads, k_cache, v_cache, slots)
        else:
            qk = RotaryStep(positions, cos, sin_rolled, None).rotate(qk, heads)
            write_kv(qk[:, heads:], v, k_cache, v_cache, slots)
        results.append((qk, k_cache, v_cache))
    return results


def compare_kernels(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    for shape in SHAPES:
        fused, reference = _rotation_case(shape, dtype, device)
        for got, want in zip(fused, reference):
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        # negative control: the plain sin table (no negated half) must be caught
        wrong, reference = _rotation_case(shape, dtype, device, sin_table="plain")
        assert not torch.allclose(wrong[0], reference[0], atol=tolerance, rtol=tolerance)
    generator = torch.Generator().manual_seed(1)
    for rows, size in ((1, 1536), (5, 100), (3, 2048)):
        gate_up = torch.randn(rows, 2 * size, generator=generator).to(device, dtype)
        gate, up = gate_up.split(size, dim=-1)
        expected = torch.nn.functional.silu(gate.float()) * up.float()
        torch.testing.assert_close(TritonOps.silu_mul(gate_up).float(), expected,
                                   atol=tolerance, rtol=tolerance)
        # negative control: gate and up swapped is a different function
        swapped = torch.nn.functional.silu(up.float()) * gate.float()
        assert not torch.allclose(TritonOps.silu_mul(gate_up).float(), swapped,
                                  atol=tolerance, rtol=tolerance)


def compare_engine(device: torch.device, model_folder: str) -> None:
    """Greedy tokens with the fused ops equal the torch path's, plain and with n-gram
    speculation (verify steps of several rows), flat and padded steps; and the fused ops ran."""
    from engine import LLM, SamplingParams
    from engine.core.memory import CPU_KV_CACHE_GIB
    from engine.models import triton_ops

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
               "The cat sat on the mat. The cat sat on the", "Hello"]
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    calls = []
    rotate = TritonOps.rotate_and_store
    TritonOps.rotate_and_store = staticmethod(lambda *a: calls.append(1) or rotate(*a))
    for padded in (False, True):
        runs = {}
        for fused in ("0", "1"):
            os.environ["SPECSERVE_DISABLE_TRITON_OPS"] = "0" if fused == "1" else "1"
            for method in ("none", "ngram"):
                llm = LLM(model_folder, device=str(device), dtype="float32", padded_steps=padded,
                          kv_cache_memory_gib=CPU_KV_CACHE_GIB, enforce_eager=True,
                          speculative_method=method, num_speculative_tokens=3, adaptive=False)
                runs[fused, method] = [o.token_ids for o in llm.generate(prompts, params)]
        assert len(set(map(str, runs.values()))) == 1, (padded, runs)
    assert calls and triton_ops.ops_for(torch.zeros(1, device=device)) is not None
    os.environ.pop("SPECSERVE_DISABLE_TRITON_OPS")


CHECKS = {"kernels": compare_kernels, "engine": compare_engine}

if __name__ == "__main__":
    from tests.engine.interpreted import main

    main(CHECKS)
