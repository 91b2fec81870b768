"""The Triton paged-attention kernel against the torch backend: the checks themselves.

Run in-process on CUDA by test_triton_attention.py, and on the CPU as a script under Triton's
interpreter (`TRITON_INTERPRET=1 python -m tests.engine.triton_attention_cases kernel`): the
interpreter must be chosen before triton is imported, so the CPU run needs a fresh process.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import BatchedGroup, build_attention_metadata
from engine.attention.torch_backend import paged_attention

# (heads, kv heads, head dim, block size): SmolLM2's 9/3 x 64 grouping, plain multi-head.
SHAPES = [(9, 3, 64, 16), (4, 4, 16, 32), (8, 2, 32, 16)]
# Requests as (query length, context length): decodes, drafts to verify, a 16-row query, a
# context of one token, contexts across many blocks.
REQUESTS = [(1, 17), (4, 40), (3, 5), (1, 1), (16, 70), (2, 33)]


def _case(shape, dtype, device, seed=0):
    heads, kv_heads, head_dim, block_size = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator).to(device, dtype)

    blocks_each = -(-max(c for _, c in REQUESTS) // block_size)
    num_blocks = blocks_each * len(REQUESTS) + 3
    # Scattered, out-of-order block ids per request.
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [order[i * blocks_each:(i + 1) * blocks_each] for i in range(len(REQUESTS))]
    k_cache, v_cache = randn(num_blocks, block_size, kv_heads, head_dim), \
        randn(num_blocks, block_size, kv_heads, head_dim)
    tokens = sum(q for q, _ in REQUESTS)
    # q as the model makes it: a strided view of a wider projection.
    qk = randn(tokens, heads + kv_heads, head_dim)
    q, k, v = qk[:, :heads], qk[:, heads:], randn(tokens, kv_heads, head_dim)
    return q, k, v, k_cache, v_cache, tables, block_size


def compare_kernel(device: torch.device, dtype: torch.dtype, tolerance: float) -> None:
    for shape in SHAPES:
        q, k, v, k_cache, v_cache, tables, block_size = _case(shape, dtype, device)
        meta = build_attention_metadata([r[0] for r in REQUESTS], [r[1] for r in REQUESTS],
                                        tables, block_size, device)
        got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, "triton")
        # in place: the caches now hold this step's KV too, as the padded run below needs
        expected = paged_attention(q, k, v, k_cache, v_cache, meta, "torch")
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        # The padded layout of static steps: every request padded to 16 rows, read in place.
        num_seqs, max_q = len(REQUESTS), 16
        rows = torch.arange(num_seqs * max_q, device=device).view(num_seqs, max_q)
        tables_t = torch.tensor(tables, device=device)
        group = BatchedGroup(
            token_index=rows, real_rows=rows.flatten(), real_token_index=rows.flatten(),
            block_tables=tables_t, query_lens=torch.tensor([r[0] for r in REQUESTS],
                                                           device=device),
            context_lens=torch.tensor([r[1] for r in REQUESTS], device=device),
            num_seqs=num_seqs, max_query_len=max_q, block_size=block_size, identity_layout=True)
        padded_q = q.new_zeros(num_seqs * max_q, *q.shape[1:])
        start = 0
        for i, (q_len, _) in enumerate(REQUESTS):
            padded_q[i * max_q:i * max_q + q_len] = q[start:start + q_len]
            start += q_len
        out = torch.empty_like(padded_q)
        from engine.attention import triton_backend

        triton_backend.paged_attention_short(padded_q, k_cache, v_cache, group, out)
        start = 0
        for i, (q_len, _) in enumerate(REQUESTS):
            torch.testing.assert_close(out[i * max_q:i * max_q + q_len],
                                       expected[start:start + q_len], atol=tolerance,
                                       rtol=tolerance)
            start += q_len
        assert torch.isfinite(out).all()  # padding rows too


def compare_engine(device: torch.device, model_folder: str) -> None:
    """Greedy tokens with the Triton backend equal the torch backend's: plain and ngram
    speculation (verify steps of several rows), flat and padded steps."""
    from engine import LLM, SamplingParams
    from engine.core.memory import CPU_KV_CACHE_GIB

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
               "The cat sat on the mat. The cat sat on the", "Hello"]
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    for padded in (False, True):
        runs = {}
        for backend in ("torch", "triton"):
            llm = LLM(model_folder, device=str(device), dtype="float32", padded_steps=padded,
                      # the CPU's default, not 0.9 of a GPU for each of the four engines
                      kv_cache_memory_gib=CPU_KV_CACHE_GIB,
                      enforce_eager=True, speculative_method="ngram", num_speculative_tokens=3,
                      adaptive=False, attention_backend=backend)
            widths = set()
            if padded:
                runner = llm.engine.static_runner
                prepare = runner.prepare
                runner.prepare = lambda s: widths.add((step := prepare(s)).shape.width) or step
            runs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
            if padded and backend == "triton":  # one block-table width for every step
                assert widths == {llm.engine.static_runner.max_blocks}, widths
            elif padded:
                assert len(widths) > 1  # the torch backend cuts tables to the longest
        assert runs["triton"] == runs["torch"], (padded, runs)


CHECKS = {"kernel": compare_kernel, "engine": compare_engine}

if __name__ == "__main__":
    from tests.engine.interpreted import main

    main(CHECKS)
