"""Structured outputs under speculation: `ngram` (with grammar-forced drafts) against `none` on the
JSON workload (`benchmarks/json_workload.py`), the same grammar for both, on the serving model.

    python -m benchmarks.structured --output benchmarks/results/structured.json

1. Batch 1, greedy: every item alone, the methods taking turns on each (in a rotating order:
   whichever goes first runs slower); tokens/s, the ratio to `none`, forced and proposed
   drafts, whether the tokens equal `none`'s. Twice: with every
   prompt new to the engine (prefix caching off: each prefill in full), and as the server runs
   by default (prefix caching on, a fresh cache at the start: a request finds the system message
   of earlier requests with the same schema cached, never its own prompt).
2. Concurrency (`--concurrency`, greedy): the items cycled to c requests in one generate call.
3. Grammar overhead (concurrent runs): the time spent in grammar work (masks for every verified
   row, applying them, forced drafts and the look-ahead behind them, checking drafts, advancing
   matchers; `GrammarTimer`) as a share of the decode time.

Rates: end to end (`tokens_per_s`, prefill included: the schema in the system message makes
prompts long) and decode (`decode_tokens_per_s`: the tokens after each request's first over the
time after every request had its first, both timed in the same run).
4. Validity: every finished output checked against its JSON schema with jsonschema.

Everything in one process, side by side; compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import time

import torch
from transformers import AutoTokenizer

import engine.engine as engine_module
from benchmarks.json_workload import SHAPES, is_valid, load_json_items
from benchmarks.machine import cpu_model
from specserve.bench.report import emit, taking_turns
from engine import LLM, SamplingParams
from engine.core.memory import CPU_KV_CACHE_GIB
from engine.grammar import GrammarMatcher
from engine.metrics.spec_stats import SpecStats
from engine.models.loader import resolve_model_folder
from engine.sample import sampler
from engine.spec_decode import speculation

METHODS = ("none", "ngram")


class GrammarTimer:
    """Wraps the engine's grammar work with timers while active: every call into a request's
    matcher (masks, forced tokens, look-ahead and rollback of drafts, checking drafts, advancing),
    building and applying the masks, and finding the rows they decide. Calls inside a timed call
    count once; the n-gram lookups that `interleave_drafts` makes between forced runs are not
    grammar work and are not timed."""

    PATCHES = [(engine_module, "build_bitmask"), (engine_module, "known_next_tokens"),
               (sampler, "mask_logits"), (speculation, "constrain_drafts"),
               *((GrammarMatcher, name) for name in (
                   "accept", "valid_prefix", "look_ahead", "roll_back_look_ahead",
                   "forced_tokens", "fill_masks"))]

    def __init__(self):
        self.seconds = 0.0
        self._saved = []
        self._depth = 0

    def _timed(self, function):
        def wrapper(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start
        return wrapper

    def __enter__(self):
        for owner, name in self.PATCHES:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved.clear()


class FirstTokenTimes:
    """The engine's own per-request stats, as the server's metrics get them: each finished
    request's time to its first token."""

    def __init__(self, llm: LLM):
        self.seconds: list[float] = []
        llm.engine.add_stat_listener(self)

    def on_step(self, stats) -> None:
        pass

    def on_request_finished(self, summary) -> None:
        self.seconds.append(summary.time_to_first_token)


def run(llm: LLM, items, max_tokens: int) -> tuple[list, float, float]:
    """The items in one `generate` call: (outputs, seconds, seconds until every request had its
    first token)."""
    times = getattr(llm, "first_token_times", None) or FirstTokenTimes(llm)
    llm.first_token_times, times.seconds = times, []
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, structured=item.constraint)
              for item in items]
    start = time.perf_counter()
    outputs = llm.generate([item.prompt_ids for item in items], params)
    return outputs, time.perf_counter() - start, max(times.seconds)


def measure(llm: LLM, items, max_tokens: int, timed: bool = False) -> tuple[list, dict]:
    with GrammarTimer() if timed else contextlib.nullcontext() as timer:
        outputs, seconds, prefill_seconds = run(llm, items, max_tokens)
    stats = SpecStats()
    for output in outputs:
        if output.spec_stats is not None:
            stats.merge(output.spec_stats)
    finished = [(o, item) for o, item in zip(outputs, items) if o.finish_reason == "stop"]
    record = {"tokens": sum(len(o.token_ids) for o in outputs), "seconds": seconds,
              "prefill_seconds": prefill_seconds,
              "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
              "finished": len(finished), "cut_by_max_tokens": len(outputs) - len(finished),
              "valid": sum(is_valid(o.text, item.schema) for o, item in finished),
              "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
              "forced_draft_tokens": stats.num_forced_draft_tokens,
              "forced_accepted_tokens": stats.num_forced_accepted_tokens}
    if timed:
        record["grammar_seconds"] = timer.seconds
    return outputs, record


def rates(records: list[dict], num_requests: int) -> dict:
    """Summed records with their rates: end to end (prefill included), and decode (the tokens
    after each request's first over the time after every request had its first)."""
    total = {key: sum(r[key] for r in records) for key in records[0]}
    decode_seconds = total["seconds"] - total["prefill_seconds"]
    total["tokens_per_s"] = total["tokens"] / total["seconds"]
    total["decode_tokens_per_s"] = (total["tokens"] - num_requests) / decode_seconds
    if "grammar_seconds" in total:
        total["grammar_share_of_decode"] = total["grammar_seconds"] / decode_seconds
    return {key: round(value, 4) if isinstance(value, float) else value
            for key, value in total.items()}


def compare(row: dict, tokens: dict) -> dict:
    for method in row:
        if method != "none":
            for rate in ("tokens_per_s", "decode_tokens_per_s"):
                row[method][f"{rate}_vs_none"] = round(row[method][rate] / row["none"][rate], 3)
            row[method]["equal_to_none"] = tokens[method] == tokens["none"]
    return row


def batch_one(llms: dict[str, LLM], items, max_tokens: int) -> dict:
    """Per shape and overall: the methods taking turns on every item."""
    records = {m: [] for m in llms}
    for n, item in enumerate(items):
        for method in taking_turns(list(llms), n):
            outputs, record = measure(llms[method], [item], max_tokens)
            records[method].append((item, outputs[0].token_ids, record))
    result = {}
    for shape in [*dict.fromkeys(item.shape for item in items), "all"]:
        chosen = {m: [e for e in entries if shape in ("all", e[0].shape)]
                  for m, entries in records.items()}
        result[shape] = compare({m: rates([e[2] for e in c], len(c)) for m, c in chosen.items()},
                                {m: [e[1] for e in c] for m, c in chosen.items()})
    return result


def concurrent(llms: dict[str, LLM], items, max_tokens: int, level: int) -> dict:
    batch = [items[i % len(items)] for i in range(level)]
    row, tokens = {}, {}
    for method in taking_turns(list(llms), level):
        outputs, record = measure(llms[method], batch, max_tokens, timed=True)
        row[method] = rates([record], level)
        tokens[method] = [o.token_ids for o in outputs]
    return compare(row, tokens)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded GGUF (native kernels)")
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per shape")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="16")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="skip the batch-1 pass with prefix caching on (the server's default)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    folder, model_name = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    items = load_json_items(tokenizer, args.num_prompts, args.shapes.split(","))
    llms = {m: LLM(args.model, speculative_method=m, enable_prefix_caching=False,
                   kv_cache_memory_gib=CPU_KV_CACHE_GIB) for m in METHODS}
    for llm in llms.values():  # warm-up, and every constraint compiled before timing
        run(llm, items, 8)
    cached = {}
    if args.prefix_caching:
        cached = {m: LLM(args.model, speculative_method=m, enable_prefix_caching=True,
                         kv_cache_memory_gib=CPU_KV_CACHE_GIB) for m in METHODS}
        for llm in cached.values():  # warm-up that leaves none of the items' prompts cached
            for item in items:
                llm.generate([tokenizer("Hello")["input_ids"]], SamplingParams(
                    max_tokens=8, temperature=0, structured=item.constraint))
    levels = [int(c) for c in args.concurrency.split(",")]
    report = {
        "benchmark": "structured",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name, "weights": "native GGUF" if args.model is None else args.model,
        "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(), "load_average": [round(v, 2) for v in os.getloadavg()],
        "num_items": len(items), "max_tokens": args.max_tokens,
        "batch1": batch_one(llms, items, args.max_tokens),
        # The server's default: the schema's system message cached by earlier requests.
        **({"batch1_prefix_caching": batch_one(cached, items, args.max_tokens)} if cached else {}),
        "concurrent": {str(c): concurrent(llms, items, args.max_tokens, c) for c in levels},
    }
    emit(report, args.output, indent=1)
    return report


if __name__ == "__main__":
    main()
