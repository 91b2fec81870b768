"""One decoder layer on the fused path (engine/models/fused_layer.py) against the torch
DecoderLayer: the checks, run in-process on CUDA and under Triton's interpreter on the CPU
(`TRITON_INTERPRET=1 python -m tests.engine.fused_layer_cases layer`), as fused_cases.py.
"""

from __future__ import annotations

import os

import torch

from engine.attention.metadata import build_attention_metadata
from engine.models import fused_layer, skinny_gemm
from engine.models.architecture import LlamaArchitecture
from engine.models.decoder_layer import DecoderLayer
from engine.models.layers import RotaryEmbedding
from engine.models.skinny_tiles import Tiles

BLOCK_SIZE, NUM_BLOCKS = 16, 16
# One step of four requests: a decode row, a verify step of 4 rows, a prefill chunk that is its
# whole context (attended on the fresh keys) and one past cached context (read from the cache).
QUERY_LENS, CONTEXT_LENS = [1, 4, 18, 17], [20, 33, 18, 40]


def tiny_arch(**overrides) -> LlamaArchitecture:
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5,
                    max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=False,
                    o_bias=False, mlp_bias=False, rope_theta=1e4, rope_scaling=None)
    settings.update(overrides)
    return LlamaArchitecture(**settings)


def _layer(arch, device, dtype) -> DecoderLayer:
    layer = DecoderLayer(arch)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.1 if param.dim() == 1 else param.shape[1] ** -0.5
            offset = 1.0 if param.dim() == 1 else 0.0  # norm gains about 1
            param.copy_(torch.randn(param.shape, generator=generator) * scale + offset)
    return layer.to(device, dtype)


def _step(arch, device, dtype):
    """(x, rope, meta, k_cache, v_cache): the step's rows and caches holding random history."""
    generator = torch.Generator().manual_seed(1)
    tables = torch.randperm(NUM_BLOCKS, generator=generator).view(4, 4).tolist()
    meta = build_attention_metadata(QUERY_LENS, CONTEXT_LENS, tables, BLOCK_SIZE, device)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(QUERY_LENS, CONTEXT_LENS)])
    rope = RotaryEmbedding(arch).to(device).at(positions.to(device), dtype)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    x = torch.randn(sum(QUERY_LENS), arch.hidden_size, generator=generator).to(device, dtype)
    return x, rope, meta, k_cache, v_cache


def _run(layer, fused: bool, backend: str, arch, device, dtype):
    x, rope, meta, k_cache, v_cache = _step(arch, device, dtype)
    layer.fused = fused
    layer.self_attn.backend = backend
    with torch.inference_mode():
        out = layer(x, rope, k_cache, v_cache, meta)
    return out, k_cache, v_cache


def _close(a, b, tolerance) -> bool:
    return all(torch.allclose(x.float(), y.float(), atol=tolerance, rtol=tolerance)
               for x, y in zip(a, b))


def check_layer(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    """The layer's output and the KV it writes match the torch path's, with either attention
    backend, for decode, verify and prefill-chunk rows in one step. Negative control: the fused
    path with its projections' residual dropped fails the same comparison."""
    arch = tiny_arch()
    layer = _layer(arch, device, dtype)
    calls = []
    qkv_rope = skinny_gemm.norm_qkv_rope
    skinny_gemm.norm_qkv_rope = lambda *a, **k: calls.append(1) or qkv_rope(*a, **k)
    try:
        for backend in ("torch", "triton"):
            calls.clear()
            want = _run(layer, False, backend, arch, device, dtype)
            assert not calls
            got = _run(layer, True, backend, arch, device, dtype)
            assert calls, "the fused path did not run"
            assert _close(got, want, tolerance), backend
    finally:
        skinny_gemm.norm_qkv_rope = qkv_rope
    linear = skinny_gemm.linear
    skinny_gemm.linear = lambda x, weight, residual=None, tiles=None: linear(x, weight)
    try:
        assert not _close(_run(layer, True, "torch", arch, device, dtype), want, tolerance)
    finally:
        skinny_gemm.linear = linear


def check_engine(device: torch.device, model_folder: str) -> None:
    """The engine on the fused path, with n-gram speculation (decode steps and verify steps of
    several rows), gives the greedy tokens of `none`: on the CPU (the interpreter, float32,
    flat steps) `none` on the torch path; on CUDA (bfloat16, --batch-invariant, padded steps in
    graphs) `none` on the fused path, exactly, as the fused kernels are row-invariant. Either
    way the fused path ran on every layer, and only where asked."""
    from engine import LLM, SamplingParams
    from engine.core.memory import CPU_KV_CACHE_GIB

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
               "The cat sat on the mat. The cat sat on the", "Hello"]
    params = [SamplingParams(max_tokens=12 + 4 * i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    on_gpu = device.type == "cuda"
    options = dict(device=str(device), kv_cache_memory_gib=CPU_KV_CACHE_GIB,
                   num_speculative_tokens=3, adaptive=False)
    # the interpreter is slow: on the CPU flat steps (no warm-up of every padded shape)
    options.update(dict(dtype="bfloat16", batch_invariant=True) if on_gpu
                   else dict(dtype="float32", padded_steps=False))
    cells = [(True, "ngram"), (True, "none")] if on_gpu else [(True, "ngram"), (False, "none")]
    if not on_gpu:  # plain weights, not oneDNN's packed copies, which the kernels cannot read
        from engine.models.layers import Linear

        Linear.pack_for_cpu = lambda self, keep_plain_weight=False: None
        # triton_ops' kernels off: interpreted, they made the start's cost probe take a minute
        os.environ["SPECSERVE_DISABLE_TRITON_OPS"] = "1"
    calls = []
    qkv_rope = skinny_gemm.norm_qkv_rope
    skinny_gemm.norm_qkv_rope = lambda *a, **k: calls.append(1) or qkv_rope(*a, **k)
    runs = {}
    try:
        for fused, method in cells:
            llm = LLM(model_folder, speculative_method=method,
                      fused_kernels="auto" if fused else "off", **options)
            layers = llm.engine.runner.model.layers
            if not on_gpu:  # the engine turns them on for CUDA only: here by hand
                for layer in layers:
                    layer.fused = fused and fused_layer.layer_allows(layer)
            assert all(layer.fused == fused for layer in layers), (fused, method)
            calls.clear()
            outputs = llm.generate(prompts, params)
            runs[fused, method] = [o.token_ids for o in outputs]
            assert bool(calls) == fused, (fused, method)
            if method == "ngram":  # verify steps of several rows ran
                assert sum(o.spec_stats.num_draft_tokens for o in outputs) > 0
    finally:
        skinny_gemm.norm_qkv_rope = qkv_rope
    assert len(set(map(str, runs.values()))) == 1, runs


def _first_row(layer, arch, device, dtype, query_lens, context_lens) -> torch.Tensor:
    """The layer's output at the step's first row (a decode row of 20 tokens of context, its
    input and history the same in every call), the other requests' rows beside it."""
    generator = torch.Generator().manual_seed(2)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    x = torch.randn(sum(query_lens), arch.hidden_size, generator=generator)
    x[0] = torch.randn(arch.hidden_size, generator=torch.Generator().manual_seed(3))
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(query_lens))]  # 48 tokens each
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, device)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    rope = RotaryEmbedding(arch).to(device).at(positions.to(device), dtype)
    with torch.inference_mode():
        return layer(x.to(device, dtype), rope, k_cache, v_cache, meta)[:1]


def check_layer_invariance(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    """A decode row's output of the fused layer (with the Triton attention kernel) is bitwise
    the same alone and in steps with other decode rows and a verify request of 4 or 16 rows.
    Negative control: the products' inner dimension summed in 32-column chunks once the step
    has company fails the same comparison (in float32, where the difference is not rounded
    away)."""
    arch = tiny_arch()
    layer = _layer(arch, device, dtype)
    layer.fused, layer.self_attn.backend = True, "triton"
    alone = _first_row(layer, arch, device, dtype, [1], [20])
    steps = [([1, 4, 1], [20, 33, 9]), ([1, 1, 1, 1, 16], [20, 5, 6, 7, 40])]
    for query_lens, context_lens in steps:
        together = _first_row(layer, arch, device, dtype, query_lens, context_lens)
        assert torch.equal(together, alone), query_lens
    if dtype != torch.float32:
        return
    linear = skinny_gemm.linear
    skinny_gemm.linear = lambda x, weight, residual=None, tiles=None: linear(
        x, weight, residual, None if len(x) == 1 else Tiles(16, 32))
    try:
        differs = [not torch.equal(_first_row(layer, arch, device, dtype, *step), alone)
                   for step in steps]
    finally:
        skinny_gemm.linear = linear
    assert all(differs), differs


CHECKS = {"layer": check_layer, "layer_invariance": check_layer_invariance,
          "engine": check_engine}

if __name__ == "__main__":
    from tests.engine.interpreted import main

    main(CHECKS)
