"""Compiles the fused skinny-GEMM kernel (engine/models/skinny_kernel.py) to PTX for an H100/H200
(sm_90) on a machine without a GPU, at the tiles the default model and the 8B shape run with:
what only the compiler sees (types, layouts, constexpr branches) is checked before a GPU is lent.
Run by test_fused_kernels.py as `python -m tests.engine.fused_compile` (no TRITON_INTERPRET).
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.models.skinny_gemm import PLAIN, ROPE, SILU
from engine.models.skinny_kernel import skinny_kernel
from engine.models.skinny_tiles import BLOCK_ROWS, tiles_for

POINTERS = ("x_ptr", "norm_ptr", "w_ptr", "residual_ptr", "out_ptr", "cos_ptr", "sin_ptr",
            "k_cache_ptr", "v_cache_ptr")
INTEGERS = ("num_rows", "stride_x", "stride_w", "stride_residual", "stride_out", "stride_cos",
            "stride_cache_slot", "stride_cache_head")
# (epilogue, kind, weight [out, in], heads, kv heads, head dim, PDL): the default model's three
# epilogues, the 8B shape's RoPE (head dim 128) and gate/up, one with PDL.
CASES = [(ROPE, "qkv", (960, 576), 9, 3, 64, False),
         (SILU, "gate_up", (3072, 576), 0, 0, 64, False),
         (PLAIN, "linear", (576, 1536), 0, 0, 64, False),
         (ROPE, "qkv", (6144, 4096), 32, 8, 128, False),
         (SILU, "gate_up", (28672, 4096), 0, 0, 128, True)]


def compile_case(epilogue, kind, weight, num_heads, num_kv, head_dim, pdl) -> str:
    out_features, in_features = weight
    paired = kind != "linear"
    tiles = tiles_for(kind, out_features // (2 if paired else 1), in_features, head_dim // 2)
    signature = {name: "*bf16" for name in POINTERS}
    signature.update({name: "i32" for name in INTEGERS}, slot_ptr="*i64", eps="fp32")
    constants = dict(
        K=in_features, OUT_COLUMNS=out_features // (2 if kind == "gate_up" else 1),
        PAIR_OFFSET={"qkv": head_dim // 2, "gate_up": out_features // 2}.get(kind, 0),
        EPILOGUE=epilogue, NORM=paired, HAS_RESIDUAL=not paired, NUM_HEADS=num_heads,
        NUM_KV=num_kv, HEAD_DIM=head_dim, BLOCK_M=BLOCK_ROWS, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, PRECISION=None, PDL=pdl)
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(skinny_kernel, signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl))
    return compiled.asm["ptx"]


if __name__ == "__main__":
    for case in CASES:
        ptx = compile_case(*case)
        assert ("griddepcontrol.wait" in ptx) == ("griddepcontrol.launch_dependents" in ptx) \
            == case[-1], case
    print("ok")
