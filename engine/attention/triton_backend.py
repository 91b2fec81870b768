"""Paged attention for decode and verify steps as one Triton kernel that reads the block table.

The torch backend gathers every request's KV pages into a padded copy, per layer, and then calls
SDPA with a mask: three kernels and a copy of the whole context. Here one kernel does it: a
program per (request, KV head) walks the request's blocks through the block table and keeps an
online softmax (FlashAttention's running max and sum), for all the query heads that share the KV
head and all the request's query rows (its last token and its drafts) at once, each row seeing
the keys up to its own position. Prefill chunks stay on the torch backend.

On an H100 at batch 1 (SmolLM2: 3 KV heads, so 3 programs) this kernel was a third of the
step's device time, 11.5 us a layer (docs/gpu.md): each program walked the context one 16-key
block at a time. It now scores KEYS_PER_STEP keys an iteration, each key's block looked up in
the table; not yet timed on a GPU.

The default on CUDA (`--attention-backend auto`). Its tests run the same kernel on the CPU under
Triton's interpreter (TRITON_INTERPRET=1), against the torch backend.

Triton compiles a kernel per specialization: per value of each constexpr, and by default per
"divisible by 16 / equal to 1" class of every integer and pointer argument. A flat step's metadata
(token index, block tables, lengths) are slices of one host buffer at offsets that vary step to
step, so their pointers' alignment and the tables' stride would each have made a new
specialization, compiled in the middle of serving. They are not specialized on (they are gathered
a scalar at a time: alignment buys nothing there), which leaves one kernel per query length
(MAX_Q) and dtype; `warm` builds them all at start (engine/metrics/first_use.py counts any that
is still first met while serving).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from engine.attention.metadata import MAX_QUERY_LEN_BATCHED, BatchedGroup
from engine.core.cache_dir import use_triton_cache_dir
from engine.core.triton_jit import jit_options


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    use_triton_cache_dir()

    @triton.jit(**jit_options(
        do_not_specialize=["stride_table", "stride_index"],
        do_not_specialize_on_alignment=["token_index_ptr", "block_tables_ptr",
                                        "query_lens_ptr", "context_lens_ptr"]))
    def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        token_index_ptr, block_tables_ptr, query_lens_ptr, context_lens_ptr,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table, stride_index, scale,
        QUERY_GROUP: tl.constexpr, MAX_Q: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_len = tl.load(query_lens_ptr + seq)
        context_len = tl.load(context_lens_ptr + seq)
        # Row i of the KV head's rows: query head kv_head * QUERY_GROUP + i // MAX_Q, query row
        # i % MAX_Q of the request; this program takes ROWS of them. Padding rows attend as the
        # request's last real row.
        rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
        real = rows < QUERY_GROUP * MAX_Q
        query_row = rows % MAX_Q
        head = kv_head * QUERY_GROUP + rows // MAX_Q
        token = tl.load(token_index_ptr + seq * stride_index + query_row, mask=real, other=0)
        position = context_len - q_len + tl.minimum(query_row, q_len - 1)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
                    + dims[None, :], mask=real[:, None], other=0.0)
        # KEYS keys per iteration (several blocks, each key's block looked up in the table):
        # at batch 1 a program walks a whole context alone, so fewer, wider steps matter.
        keys = tl.arange(0, KEYS)
        running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        for start in range(0, context_len, KEYS):
            key = start + keys
            in_table = key // BLOCK_SIZE < num_blocks
            block = tl.load(block_tables_ptr + seq * stride_table + key // BLOCK_SIZE,
                            mask=in_table, other=0)
            slots = key % BLOCK_SIZE
            k = tl.load(k_cache_ptr + block[:, None] * stride_k_block
                        + slots[:, None] * stride_k_slot + kv_head * stride_k_head
                        + dims[None, :], mask=in_table[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            # scores: [ROWS, KEYS]
            visible = key[None, :] <= position[:, None]
            scores = tl.where(visible, scores, float("-inf"))
            # Every row sees key 0 in the first block, so the running max is finite from there.
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            p = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_v_block
                        + slots[:, None] * stride_v_slot + kv_head * stride_v_head
                        + dims[None, :], mask=in_table[:, None], other=0.0)
            acc = acc * rescale[:, None] \
                + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=real[:, None])

    return paged_attention_kernel


# Keys a program scores per loop iteration (a power of two, at least one block).
KEYS_PER_STEP = 64
# Query rows a program attends, whatever the step's query length: a row's softmax sums are
# reduced in an order that may follow the program's tile shape, so with one shape a verified
# row gets bitwise the result of a decoded one. Wider queries take more programs, each walking
# the context again.
ROWS_PER_PROGRAM = 16


def check_available() -> None:
    """Raises ValueError with what to do when Triton cannot be imported."""
    try:
        importlib.import_module("triton")
    except ImportError as error:
        raise ValueError("--attention-backend triton needs the triton package (CUDA builds of "
                         f"torch bring it; pip install triton): {error}") from None


def resolve(name: str, device: torch.device) -> str:
    """The backend `name` means on `device`: 'auto' is this kernel on CUDA where triton is
    installed (a batch-1 step of the default model took 1.99 ms against the torch backend's
    2.53 on an H100, docs/gpu.md), the torch backend elsewhere."""
    if device.type == "cuda":
        use_triton_cache_dir()  # before any kernel of the engine compiles
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the kernel takes: Triton's matrix products want power-of-two sides >= 16."""
    block_size, _, head_dim = k_cache.shape[1:]
    return (_power_of_two(block_size) and _power_of_two(head_dim) and q.stride(-1) == 1
            and k_cache.stride(-1) == 1)


def paged_attention_short(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], unit stride in head_dim
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's KV in
    v_cache: torch.Tensor,
    group: BatchedGroup,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; the group's rows are written
) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    query_group = num_heads // num_kv_heads
    row_programs = -(-query_group * group.max_query_len // ROWS_PER_PROGRAM)
    token_index = group.token_index
    _kernel()[(group.num_seqs, num_kv_heads, row_programs)](
        q, k_cache, v_cache, out, token_index, group.block_tables, group.query_lens,
        group.context_lens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        group.block_tables.stride(0), token_index.stride(0), head_dim ** -0.5,
        QUERY_GROUP=query_group, MAX_Q=group.max_query_len, ROWS=ROWS_PER_PROGRAM,
        BLOCK_SIZE=k_cache.shape[1], KEYS=max(KEYS_PER_STEP, k_cache.shape[1]), HEAD_DIM=head_dim,
        # float32 stays float32 (Triton's default for it is TF32's 10-bit mantissa)
        PRECISION="ieee" if q.dtype == torch.float32 else None,
    )


def warm(k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], one layer's
         v_cache: torch.Tensor, num_heads: int,
         max_query_len: int = MAX_QUERY_LEN_BATCHED) -> int:
    """Launches the kernel once at every query length from 1 to `max_query_len` (a flat step
    batches queries up to MAX_QUERY_LEN_BATCHED long; padded steps use some of them), so that
    each specialization is built before the first request. Reads block 0, writes a scratch
    output. Returns how many launches ran (0 off CUDA, where nothing compiles)."""
    if k_cache.device.type != "cuda":
        return 0
    device, head_dim = k_cache.device, k_cache.shape[-1]
    block_size = k_cache.shape[1]
    for q_len in range(1, max_query_len + 1):
        q = torch.zeros(q_len, num_heads, head_dim, dtype=k_cache.dtype, device=device)
        if not supports(q, k_cache):
            return 0
        rows = torch.arange(q_len, device=device)
        lengths = torch.full((1,), q_len, dtype=torch.long, device=device)
        group = BatchedGroup(
            token_index=rows.view(1, q_len), real_rows=rows, real_token_index=rows,
            block_tables=torch.zeros(1, -(-q_len // block_size), dtype=torch.long,
                                     device=device),
            query_lens=lengths, context_lens=lengths, num_seqs=1, max_query_len=q_len,
            block_size=block_size, identity_layout=True)
        paged_attention_short(q, k_cache, v_cache, group, torch.empty_like(q))
    return max_query_len
