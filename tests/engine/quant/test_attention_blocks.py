"""Attention's query blocks (attention_blocks_impl.h): where the variant has 32 vector
registers (AVX-512), query heads that read the same keys share each key and value load. A
query's result must be bitwise what it computes alone, the only query of its call, whatever it
was blocked with; in every float variant this CPU runs (SPECSERVE_FLOAT_ISA picks one for a
process, the `isa` argument for a call)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.engine.quant.attention_inputs import attention_inputs

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 9, 3, 16
VARIANTS = ["generic", "avx2", "avx512"]  # isa.h FloatIsa, in order


@pytest.fixture(params=range(len(VARIANTS)), ids=VARIANTS)
def isa(request, ops):
    if request.param > ops.best_isa():
        pytest.skip(f"this CPU does not run {VARIANTS[request.param]}")
    return request.param


def test_queries_are_blocked_in_the_avx512_variant(ops, isa):
    """AVX-512's 32 registers hold three queries' accumulators; AVX2 and generic code takes
    queries one at a time."""
    assert ops.attention_query_block(isa) == (3 if isa == 2 else 1)


def test_an_environment_variable_picks_a_narrower_variant(ops):
    """SPECSERVE_FLOAT_ISA runs a variant the CPU has (AVX2 on an AVX-512 machine: what an
    AVX2-only CPU runs); a name it lacks, or no such name, fails when the kernel loads."""
    code = ("from engine.quant.kernels import load_kernel; m = load_kernel(); "
            "print(m.float_isa(), m.attention_query_block())")

    def run(value: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "SPECSERVE_FLOAT_ISA": value})

    for variant in range(ops.best_isa() + 1):
        forced = run(VARIANTS[variant])
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.split() == [str(variant), "3" if variant == 2 else "1"]
    if ops.best_isa() < 2:
        refused = run("avx512")
        assert refused.returncode != 0 and "not available on this CPU" in refused.stderr
    wrong = run("avx9000")
    assert wrong.returncode != 0 and "SPECSERVE_FLOAT_ISA must be" in wrong.stderr


def _alone(ops, q_head, k_head, v_head, table, num_keys, **options):
    """One query head over its KV head's first num_keys keys, the only query of its call (one
    head, one KV head: nothing to block it with)."""
    out = torch.full_like(q_head, float("nan"))
    ops.paged_attention_small(q_head, k_head, v_head, torch.tensor([[0]]), torch.tensor([1]),
                              torch.tensor([num_keys]), table.unsqueeze(0), out, **options)
    return out[0, 0]


FORMS = {"plain": {}, "window": {"window": 90}}
# (rows of each request, its context): a verify step of 16 rows beside a decode row and a
# prefill-sized chunk (an item a KV head: blocks of rows and of a row's heads, cut into chunks for
# the threads); decode and short verify rows only (an item holds all of a request's KV heads); a
# lone request (its KV heads shared out over the threads).
STEPS = {"mixed": ([16, 1, 40], [500, 130, 170]), "decode": ([1, 3, 1], [700, 130, 300]),
         "lone": ([2], [500])}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_a_blocked_query_computes_what_it_computes_alone(ops, isa, threads, head_dim, form, step):
    """The steps above, and a window that cuts key tiles so that blocked queries share only part
    of a tile. Every query head of every row equals, bit for bit, that query computed alone."""
    query_lens, context_lens = STEPS[step]
    stream_rows = ops.attention_stream_rows()
    assert (max(query_lens) <= stream_rows) == (step != "mixed"), "the steps no longer cover both"
    options = {**FORMS[form], "isa": isa}
    q, k_cache, v_cache, token_index, block_tables = attention_inputs(
        query_lens, context_lens, NUM_HEADS, NUM_KV_HEADS, head_dim, seed=head_dim)
    batched = torch.full_like(q, float("nan"))
    ops.paged_attention_small(q, k_cache, v_cache, token_index, torch.tensor(query_lens),
                              torch.tensor(context_lens), block_tables, batched, **options)
    group = NUM_HEADS // NUM_KV_HEADS
    heads = [(kv, kv * group + h) for kv in range(NUM_KV_HEADS) for h in range(group)]
    for kv, head in heads:
        k_head = k_cache[:, :, kv:kv + 1].contiguous()
        v_head = v_cache[:, :, kv:kv + 1].contiguous()
        for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
            for r in range(q_len):
                row = int(token_index[s, r])
                alone = _alone(ops, q[row:row + 1, head:head + 1].contiguous(), k_head, v_head,
                               block_tables[s], ctx - q_len + r + 1, **options)
                assert torch.equal(alone, batched[row, head]), (head, s, r)


def test_the_comparison_sees_a_different_summation_order(ops):
    """The negative control: the same keys and values in reverse order are the same attention
    in exact arithmetic, and a different float32 result; so bitwise equality above means the
    same operations in the same order, not merely a close answer."""
    head_dim, num_keys = 64, 200
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(num_keys, head_dim, generator=gen)
    values = torch.randn(num_keys, head_dim, generator=gen)
    q = torch.randn(1, 1, head_dim, generator=gen) * 2
    num_blocks = -(-num_keys // BLOCK_SIZE)
    table = torch.arange(num_blocks)

    def cache(rows):
        padded = torch.zeros(num_blocks * BLOCK_SIZE, head_dim)
        padded[:num_keys] = rows
        return padded.view(num_blocks, BLOCK_SIZE, 1, head_dim)

    forward = _alone(ops, q, cache(keys), cache(values), table, num_keys)
    reverse = _alone(ops, q, cache(keys.flip(0)), cache(values.flip(0)), table, num_keys)
    torch.testing.assert_close(forward, reverse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(forward, reverse)
