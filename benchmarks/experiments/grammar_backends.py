"""llguidance against xgrammar on this CPU, on the JSON workload's schemas and this tokenizer: what
the engine's grammar backend was chosen by.

    pip install xgrammar   # not a dependency of specserve
    python -m benchmarks.experiments.grammar_backends --output benchmarks/results/grammar_backends.json

Per schema (the JSON workload's four shapes, written the way the engine writes JSON: no free
whitespace, separators ", " and ": "):
- compile: from the schema to a matcher ready for its first mask (llguidance compiles lazily,
  so its figure includes the first mask; xgrammar compiles ahead, with its cache off);
- mask: the mean time to compute one token's bitmask on the host, along a token path that both
  backends accept (a seeded random walk over llguidance's masks), accepting each token after it.
Plus each backend's one-off tokenizer set-up. Single-threaded, both; medians over `--repeats`.

Figures: docs/structured-outputs.md (the grammar backends compared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time

import torch
from transformers import AutoTokenizer

from benchmarks.json_workload import SCHEMAS, TOOLS
from benchmarks.machine import cpu_model
from specserve.bench.report import emit
from engine.grammar import Constraint
from engine.grammar.constraint import JSON_STYLE, grammar_text
from engine.grammar.masks import unpack_bitmask
from engine.models.loader import resolve_model_folder
from server.protocol import ChatCompletionRequest
from server.tools import plan_tools


def workload_schemas() -> dict[str, dict]:
    tools = plan_tools(ChatCompletionRequest(model="m", tools=TOOLS, tool_choice="required",
                                             messages=[{"role": "user", "content": "x"}]))
    return {**SCHEMAS, "tools": json.loads(tools.constraint.spec)}


def token_path(llg_tokenizer, schema: dict, vocab: int, length: int, seed: int) -> list[int]:
    """A path of tokens the schema's grammar accepts, drawn at random among allowed tokens."""
    import llguidance

    matcher = llguidance.LLMatcher(llg_tokenizer, grammar_text(Constraint.json_schema(schema)))
    words = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    rng, path = random.Random(seed), []
    while len(path) < length and not matcher.is_stopped():
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        allowed = unpack_bitmask(words[None], vocab, torch.device("cpu"))[0]
        token = rng.choice(allowed.nonzero().flatten().tolist())
        if not matcher.consume_token(token):
            break
        path.append(token)
    return path


def time_llguidance(llg_tokenizer, schema: dict, path: list[int], vocab: int) -> dict:
    import llguidance

    words = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar_text(Constraint.json_schema(schema)))
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
    compiled = time.perf_counter() - start
    masks = []
    for token in path:
        assert matcher.consume_token(token)
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        masks.append(time.perf_counter() - start)
    return {"compile_ms": compiled * 1e3, "mask_us": statistics.fmean(masks) * 1e6,
            "tokens": len(path)}


def time_xgrammar(compiler, schema: dict, path: list[int], vocab: int) -> dict:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=JSON_STYLE["whitespace_flexible"],
        separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))
    matcher = xgrammar.GrammarMatcher(compiled)
    matcher.fill_next_token_bitmask(bitmask)
    compile_seconds = time.perf_counter() - start
    masks = []
    for token in path:
        if not matcher.accept_token(token):
            break  # a path llguidance allows and xgrammar does not: timed up to here
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - start)
    return {"compile_ms": compile_seconds * 1e3, "mask_us": statistics.fmean(masks) * 1e6,
            "tokens": len(masks)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--path-length", type=int, default=120)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    import llguidance.hf
    import xgrammar

    torch.set_num_threads(1)
    folder, model_name = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    start = time.perf_counter()
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    llg_setup = time.perf_counter() - start
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    xgr_setup = time.perf_counter() - start
    schemas = {}
    for name, schema in workload_schemas().items():
        path = token_path(llg_tokenizer, schema, vocab, args.path_length, seed=len(name))
        runs = {"llguidance": [time_llguidance(llg_tokenizer, schema, path, vocab)
                               for _ in range(args.repeats)],
                "xgrammar": [time_xgrammar(compiler, schema, path, vocab)
                             for _ in range(args.repeats)]}
        schemas[name] = {backend: {key: round(statistics.median(r[key] for r in results), 3)
                                   for key in results[0]} for backend, results in runs.items()}
    report = {
        "benchmark": "grammar_backends",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name, "vocab": vocab, "cpu": cpu_model(), "machine": platform.platform(),
        "threads": 1, "path_length": args.path_length, "repeats": args.repeats,
        "tokenizer_setup_s": {"llguidance": round(llg_setup, 3),
                              "xgrammar": round(xgr_setup, 3)},
        "schemas": schemas,
        "mean": {backend: {key: round(statistics.fmean(s[backend][key] for s in
                                                       schemas.values()), 3)
                           for key in ("compile_ms", "mask_us")}
                 for backend in ("llguidance", "xgrammar")},
    }
    emit(report, args.output, indent=1)
    return report


if __name__ == "__main__":
    main()
