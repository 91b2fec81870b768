"""The start-up measurement behind the step-cost model (step_cost.py): forwards timed at the row
counts a step can have and behind a long context, before the engine serves."""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.metadata import build_attention_metadata
from engine.spec_decode.step_cost import LinearCostModel, RowShape, step_keys

logger = logging.getLogger(__name__)

# Row counts of the step-time curve. Up to 16 rows a step is one verifying request (the CPU's
# batched attention path); past 16 it is several, 16 rows each and the rest in the last, as when
# 16 decoding requests draft. 17 and 20 are there because the integer kernels' chunks of rows
# make the 17th row of a step dear and the ones after it cheap.
CURVE_ROWS = (1, 2, 3, 5, 9, 16, 17, 20, 24, 32, 48)
KEY_ROWS = (1, 16)  # rows timed behind KEY_CONTEXT cached tokens, for the key prices
KEY_CONTEXT = 512
COST_REPEATS = 5  # per timing, in rounds over every shape; the fastest counts


def measure_step_cost(model, kv_cache, block_size: int, device) -> LinearCostModel:
    """Times verify forwards (logits for every row, as verification computes them): every row
    count of CURVE_ROWS at the start of the cache, which gives the rows' curve and the price of a
    row, and KEY_ROWS behind KEY_CONTEXT cached tokens, which give what a row's attention over
    more keys adds (16 rows against 1: per row) and what reading a request's cache adds (per
    request). The fastest of COST_REPEATS timings counts, not the mean: servers started
    together, or a build beside them, slowed single timings by 2-3x, and a slope fitted on them
    kept `ngram` from drafting for hundreds of steps."""
    # positions past the model's table have no rotation (a tiny test model has 512)
    context = min(KEY_CONTEXT, model.arch.max_position_embeddings - KEY_ROWS[-1])
    shapes = [(rows, 0) for rows in CURVE_ROWS]
    if context >= KEY_ROWS[-1]:
        shapes += [(rows, context) for rows in KEY_ROWS]
    fastest: dict[tuple[int, int], float] = {}
    for shape in (shapes[0], *shapes * COST_REPEATS):  # the first warms caches up
        seconds = _time_forward(model, kv_cache, block_size, device, *shape)
        if seconds is not None:
            fastest[shape] = min(fastest.get(shape, seconds), seconds)
    kv_cache.release_pages()  # the probe's blocks hold nothing anyone reads
    plain = {rows: t for (rows, at), t in fastest.items() if at == 0}
    if 1 not in plain or 16 not in plain:
        return LinearCostModel(fixed=0.05, per_unit=0.001)
    per_row = max((plain[16] - plain[1]) / 15, 1e-7)
    cost = LinearCostModel(fixed=max(plain[1] - per_row, 0.0), per_unit=per_row,
                           row_shape=RowShape(plain))
    one, many = KEY_ROWS
    if (one, context) in fastest and (many, context) in fastest:
        added_one = fastest[one, context] - plain[one]
        added_many = fastest[many, context] - plain[many]
        per_row_key = max((added_many - added_one) / ((many - one) * context), 0.0)
        per_request_key = max(added_one / context - per_row_key, 0.0)
        cost.row_key_units = per_row_key / per_row
        cost.request_key_units = per_request_key / per_row
    for _ in range(2):  # the fit needs a weight of 3 before it sets a slope
        for (rows, at), seconds in fastest.items():
            requests = _requests(rows)
            cost.observe(rows, seconds, *step_keys([at] * len(requests), requests))
    logger.info("step cost: %.1f ms + %.2f ms per row unit; 17 rows are %.1f row units; a key "
                "attended costs %.2g units per row and %.2g per request", cost.fixed * 1e3,
                cost.per_unit * 1e3, cost.row_shape(17), cost.row_key_units,
                cost.request_key_units)
    return cost


def _requests(rows: int) -> list[int]:
    """Rows per request of a timed step: 16 each, the rest in the last."""
    return [16] * (rows // 16) + ([rows % 16] if rows % 16 else [])


def _time_forward(model, kv_cache, block_size: int, device, rows: int,
                  context: int) -> float | None:
    """Seconds of one forward of `rows` rows, each request's at positions context .. (KV written
    to the first blocks, which hold nothing yet), every row's logits read back; None where the
    cache has too few blocks."""
    requests = _requests(rows)
    blocks_each = -(-(context + max(requests)) // block_size)
    if blocks_each * len(requests) > kv_cache.num_blocks:
        return None
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(requests))]
    meta = build_attention_metadata(requests, [context + n for n in requests], tables,
                                    block_size, device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(context, context + n) for n in requests]).to(device)
    start = time.perf_counter()
    model(ids, positions, kv_cache, meta, torch.arange(rows, device=device)).cpu()
    return time.perf_counter() - start
