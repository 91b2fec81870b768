"""What drawing a sampled token costs: the inverse-CDF draw the sampler uses against the
exponential race it used before (argmax p / E, one Exponential(1) draw per vocabulary token),
each row with its own seeded generator as seeded requests have, timed in the same run. Prints
JSON: microseconds per call at each row count.

    python -m benchmarks.experiments.sampling_draws [--vocab 49152] [--rows 1,4,16,64]

Figures: docs/architecture.md (seeded sampling).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.machine import cpu_model
from engine.sample.sampler import argmax_rows, sample_from_probs


def exponential_race(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """The previous draw, kept here as the baseline."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(generator=generator)
    return argmax_rows(probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny))


def best_microseconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        probs = torch.randn(rows, args.vocab).softmax(dim=-1)
        generators = [torch.Generator().manual_seed(i) for i in range(rows)]
        inverse_cdf = best_microseconds(lambda: sample_from_probs(probs, generators),
                                        args.repeats)
        race = best_microseconds(lambda: exponential_race(probs, generators), args.repeats)
        results.append({"rows": rows, "inverse_cdf_us": round(inverse_cdf, 1),
                        "exponential_race_us": round(race, 1),
                        "speedup": round(race / inverse_cdf, 1)})
    print(json.dumps({"benchmark": "sampling_draws", "cpu": cpu_model(),
                      "threads": torch.get_num_threads(),
                      "vocab": args.vocab, "results": results}, indent=1))


if __name__ == "__main__":
    main()
