"""Attention's query blocks (attention_blocks_impl.h): where the CPU has 32 vector registers,
query heads that read the same keys share each key and value load. A query's result must be
bitwise what it computes alone, the only query of its call, whatever it was blocked with."""

from __future__ import annotations

import pytest
import torch

from engine.quant.kernels import cpu_ops_for

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 9, 3, 16


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops_for(torch.empty(0))
    if module is None:
        pytest.skip("the CPU extension is not built")
    return module


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def test_queries_are_blocked_where_the_cpu_has_avx512(ops):
    """The blocked kernels are the ones this machine runs where it has AVX-512, so the tests
    below check them there; on AVX2 and generic CPUs queries go one at a time."""
    assert ops.attention_query_block() == (3 if ops.best_isa() == 2 else 1)


def _inputs(query_lens, context_lens, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // BLOCK_SIZE)
        tables.append(list(range(used, used + n)))
        used += n
    order = torch.randperm(used, generator=gen)  # shuffled blocks
    tables = [[int(order[b]) for b in table] for table in tables]
    width = max(len(t) for t in tables)
    k_cache = torch.randn(used, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=gen)
    v_cache = torch.randn(used, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), NUM_HEADS, head_dim, generator=gen) * 2
    token_index = torch.zeros(len(query_lens), max(query_lens), dtype=torch.long)
    start = 0
    for s, n in enumerate(query_lens):
        token_index[s, :n] = torch.arange(start, start + n)
        start += n
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, token_index, block_tables


def _alone(ops, q_head, k_head, v_head, table, num_keys, **options):
    """One query head over its KV head's first num_keys keys, the only query of its call (one
    head, one KV head: nothing to block it with)."""
    out = torch.full_like(q_head, float("nan"))
    ops.paged_attention_small(q_head, k_head, v_head, torch.tensor([[0]]), torch.tensor([1]),
                              torch.tensor([num_keys]), table.unsqueeze(0), out, **options)
    return out[0, 0]


FORMS = {"plain": {}, "window": {"window": 90}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_a_blocked_query_computes_what_it_computes_alone(ops, threads, head_dim, form):
    """A verify step of 16 rows at 500 keys (blocks of rows and of a row's heads, cut into chunks
    for the threads), a decode row, and a prefill-sized chunk; a window that cuts key tiles so
    that blocked queries share only part of a tile. Every query head of every row equals, bit for
    bit, that query computed alone."""
    query_lens, context_lens = [16, 1, 40], [500, 130, 170]
    options = FORMS[form]
    q, k_cache, v_cache, token_index, block_tables = _inputs(query_lens, context_lens, head_dim,
                                                             seed=head_dim)
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
