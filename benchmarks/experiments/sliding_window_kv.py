"""KV blocks a long request holds on a sliding-window model, with the blocks behind the window
given back (the engine's way) and kept (what a cache without release holds), side by side.

    python -m benchmarks.experiments.sliding_window_kv --output benchmarks/results/sliding_window_kv.json

The model is a random Mistral built by transformers (4 layers, 256 wide, the default model's
tokenizer, `--window` keys): block accounting does not depend on the weights, and nothing is
downloaded. One request decodes `--max-tokens` greedy tokens alone; each step's blocks in use
are read from the block manager. Tokens per second are reported too: releasing costs host time.

Figures: docs/models.md (sliding-window KV release).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time

import torch

from benchmarks.machine import cpu_model
from specserve.bench.report import emit
from engine import LLM, SamplingParams
from engine.models.loader import resolve_model_folder

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home."


def build_model(folder: str, window: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    default_folder, _ = resolve_model_folder(None)
    config = AutoConfig.for_model(
        "mistral", vocab_size=49152, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, sliding_window=window, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_folder).save_pretrained(folder)


def run(llm: LLM, release: bool, max_tokens: int) -> dict:
    engine = llm.engine
    window = engine.block_manager.window
    engine.block_manager.window = window if release else None
    engine.add_request(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0,
                                              ignore_eos=True))
    held, started = [], time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        held.append(sum(1 for count in engine.block_manager.ref_counts if count))
    elapsed = time.perf_counter() - started
    engine.block_manager.window = window
    return {"peak_blocks": max(held), "blocks_at_end": held[-2] if len(held) > 1 else held[-1],
            "tokens_per_s": round(max_tokens / elapsed, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, args.window)
        llm = LLM(folder, speculative_method="none", block_size=args.block_size,
                  enable_prefix_caching=False)
        prompt_tokens = len(llm.tokenizer(PROMPT)["input_ids"])
        runs = {"released": run(llm, True, args.max_tokens),
                "kept": run(llm, False, args.max_tokens)}
    report = {
        "benchmark": "sliding_window_kv",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(), "load_average": [round(v, 2) for v in os.getloadavg()],
        "window": args.window, "block_size": args.block_size,
        "context_tokens": prompt_tokens + args.max_tokens,
        "blocks_the_window_reaches": -(-args.window // args.block_size) + 1,
        **runs,
    }
    emit(report, args.output)
    return report


if __name__ == "__main__":
    main()
