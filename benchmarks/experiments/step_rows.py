"""What a verify step costs by its shape: the default model's forward (every row's logits read
back, as verification needs them) for N requests feeding R rows each, behind C cached tokens
(written, random), the fastest of --repeats rounds over all shapes. Says what a verified row
costs beside a batch's decoded rows: on a CPU at 16 requests, about what a decoded row does
(docs/performance/agentic.md).

    python -m benchmarks.experiments.step_rows [--contexts 0,100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.machine import cpu_model, int8_variant, our_versions
from engine import LLM
from engine.attention.metadata import build_attention_metadata

SHAPES = ((1, 1), (1, 16), (2, 16), (3, 16), (16, 1), (16, 2), (16, 3), (16, 4), (16, 6),
          (16, 8), (16, 12), (16, 16))  # (requests, rows each)


def forward_seconds(model, kv_cache, num_requests: int, rows_each: int, context: int) -> float:
    block_size = kv_cache.block_size
    blocks_each = -(-(context + rows_each) // block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(num_requests)]
    query_lens = [rows_each] * num_requests
    meta = build_attention_metadata(query_lens, [context + rows_each] * num_requests, tables,
                                    block_size, torch.device("cpu"))
    rows = num_requests * rows_each
    ids = torch.zeros(rows, dtype=torch.long)
    positions = torch.arange(context, context + rows_each).repeat(num_requests)
    started = time.perf_counter()
    model(ids, positions, kv_cache, meta, torch.arange(rows)).cpu()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="0,100")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = LLM(speculative_method="none").engine
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    # Keys and values behind the rows, written: pages never written all map the OS's one zero
    # page, which stays in L1, and would leave out what reading the cache costs.
    kv_cache.storage.normal_(generator=torch.Generator().manual_seed(0))
    contexts = [int(c) for c in args.contexts.split(",")]
    fastest: dict[tuple[int, int, int], float] = {}
    for _ in range(args.repeats):
        for context in contexts:
            for shape in SHAPES:
                seconds = forward_seconds(model, kv_cache, *shape, context)
                key = (context, *shape)
                fastest[key] = min(fastest.get(key, seconds), seconds)
    print(json.dumps({
        "benchmark": "step_rows", "cpu": cpu_model(), "int8_variant": int8_variant(),
        "torch_threads": torch.get_num_threads(), "versions": our_versions(),
        "model": engine.model_name, "repeats": args.repeats,
        "steps": [{"context": c, "requests": n, "rows_each": r, "rows": n * r,
                   "ms": round(t * 1e3, 2), "ms_per_row": round(t * 1e3 / (n * r), 3)}
                  for (c, n, r), t in sorted(fastest.items())],
    }, indent=2))


if __name__ == "__main__":
    main()
