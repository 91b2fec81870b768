"""The Triton source of the fused skinny GEMMs (skinny_gemm.py says what they compute and why).

Imported only where they run (a GPU, or Triton's interpreter): it imports triton at the top, as
the interpreter reads kernels and their helpers from module globals, not closures.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.core.triton_jit import jit_options

try:  # programmatic dependent launch's instructions (Triton 3.3 on, as far as we know)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # an older Triton: never called (skinny_gemm launches without PDL)
    HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    # Programmatic dependent launch: this grid may be resident before the previous kernel ends;
    # nothing is read or written before the previous one has completed and flushed.
    if PDL:
        gdc_wait()


@triton.jit
def _let_next_kernel_launch(PDL: tl.constexpr):
    # Safe anywhere: the next kernel's gdc_wait still waits for this one to complete. After the
    # weights have streamed, its programs become resident while this one's epilogue runs.
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _rope_epilogue(first, second, rows, row_real, dims, head, columns, out_ptr, stride_out,
                   cos_ptr, sin_ptr, stride_cos, slot_ptr, k_cache_ptr, v_cache_ptr,
                   stride_cache_slot, stride_cache_head, NUM_HEADS: tl.constexpr,
                   NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr):
    # first: dims d of the head, second: dims d + HEAD_DIM / 2. With sin's first half
    # negated (RotaryEmbedding.sin_rolled), rotate_half(x) * sin is x rolled by half a head
    # times it: first' = first cos_d + second sin_d, second' = second cos_d2 + first sin_d2.
    out_type = out_ptr.dtype.element_ty
    first = first.to(out_type).to(tl.float32)
    second = second.to(out_type).to(tl.float32)
    upper = dims + HEAD_DIM // 2
    table = rows[:, None] * stride_cos
    mask = row_real[:, None]
    cos_first = tl.load(cos_ptr + table + dims[None, :], mask=mask).to(tl.float32)
    cos_second = tl.load(cos_ptr + table + upper[None, :], mask=mask).to(tl.float32)
    sin_first = tl.load(sin_ptr + table + dims[None, :], mask=mask).to(tl.float32)
    sin_second = tl.load(sin_ptr + table + upper[None, :], mask=mask).to(tl.float32)
    rotates = head < NUM_HEADS + NUM_KV  # queries and keys; values pass as they are
    first_out = tl.where(rotates, first * cos_first + second * sin_first, first).to(out_type)
    second_out = tl.where(rotates, second * cos_second + first * sin_second,
                          second).to(out_type)
    row_out = out_ptr + rows[:, None] * stride_out
    tl.store(row_out + columns[None, :], first_out, mask=mask)
    tl.store(row_out + (columns + HEAD_DIM // 2)[None, :], second_out, mask=mask)
    # The head as a per-row vector: the masks below are then plain [rows, 1] masks.
    row_head = rows * 0 + head
    is_key = (row_head >= NUM_HEADS) & (row_head < NUM_HEADS + NUM_KV)
    is_value = row_head >= NUM_HEADS + NUM_KV
    kv_head = tl.where(is_key, row_head - NUM_HEADS, row_head - NUM_HEADS - NUM_KV)
    kv_head = tl.where(is_key | is_value, kv_head, 0)
    slot = tl.load(slot_ptr + rows, mask=row_real, other=0)
    cache = slot[:, None] * stride_cache_slot + kv_head[:, None] * stride_cache_head
    key_mask = (row_real & is_key)[:, None]
    value_mask = (row_real & is_value)[:, None]
    tl.store(k_cache_ptr + cache + dims[None, :], first_out, mask=key_mask)
    tl.store(k_cache_ptr + cache + upper[None, :], second_out, mask=key_mask)
    tl.store(v_cache_ptr + cache + dims[None, :], first_out, mask=value_mask)
    tl.store(v_cache_ptr + cache + upper[None, :], second_out, mask=value_mask)


# The row count is not specialized on (one kernel for every batch size is the point), nor
# the slot mapping's alignment (a slice of the runner's buffers at varying offsets).
@triton.jit(**jit_options(do_not_specialize=["num_rows"],
                          do_not_specialize_on_alignment=["slot_ptr"]))
def skinny_kernel(
    x_ptr, norm_ptr, w_ptr, residual_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, num_rows, eps,
    stride_x, stride_w, stride_residual, stride_out, stride_cos,
    stride_cache_slot, stride_cache_head,
    K: tl.constexpr, OUT_COLUMNS: tl.constexpr, PAIR_OFFSET: tl.constexpr,
    EPILOGUE: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    _wait_for_previous_kernel(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_real = rows < num_rows
    lanes = tl.arange(0, BLOCK_N)
    if EPILOGUE == 2:  # RoPE: a block of one head's first half; its partner in the second
        per_head = (HEAD_DIM // 2) // BLOCK_N
        head = tl.program_id(0) // per_head
        dims = (tl.program_id(0) % per_head) * BLOCK_N + lanes
        columns = head * HEAD_DIM + dims
    else:
        columns = tl.program_id(0) * BLOCK_N + lanes
    column_real = columns < OUT_COLUMNS
    inner = tl.arange(0, BLOCK_K)

    rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:  # each row's mean square, summed in the same chunks whatever the row count
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + inner
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=row_real[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partner = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + inner
        k_real = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                    mask=row_real[:, None] & k_real[None, :], other=0.0)
        if NORM:  # normalised and rounded to the weights' dtype: the product's operand
            gain = tl.load(norm_ptr + k, mask=k_real, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * gain[None, :]).to(w_ptr.dtype.element_ty)
        w_mask = column_real[None, :] & k_real[:, None]
        w = tl.load(w_ptr + columns[None, :] * stride_w + k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if EPILOGUE != 0:  # a paired epilogue
            w2 = tl.load(w_ptr + (columns + PAIR_OFFSET)[None, :] * stride_w + k[:, None],
                         mask=w_mask, other=0.0)
            partner = tl.dot(x, w2, partner, input_precision=PRECISION)

    _let_next_kernel_launch(PDL)
    mask = row_real[:, None] & column_real[None, :]
    out_type = out_ptr.dtype.element_ty
    if EPILOGUE == 0:  # plain, the residual added
        if HAS_RESIDUAL:
            acc += tl.load(residual_ptr + rows[:, None] * stride_residual + columns[None, :],
                           mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + columns[None, :], acc.to(out_type),
                 mask=mask)
    elif EPILOGUE == 1:  # silu(gate) * up
        gate = acc.to(out_type).to(tl.float32)
        up = partner.to(out_type).to(tl.float32)
        activated = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * stride_out + columns[None, :],
                 activated.to(out_type), mask=mask)
    else:
        _rope_epilogue(acc, partner, rows, row_real, dims, head, columns, out_ptr, stride_out,
                       cos_ptr, sin_ptr, stride_cos, slot_ptr, k_cache_ptr, v_cache_ptr,
                       stride_cache_slot, stride_cache_head, NUM_HEADS, NUM_KV, HEAD_DIM)
