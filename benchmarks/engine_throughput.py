"""Engine throughput on the default model, side by side in one process, printed as JSON.

Measures (greedy, float32, same torch thread count for everything):
- batch-1 decode tokens/s of our engine vs transformers `generate()` on the same weights;
- our aggregate output tokens/s with 1, 4, 16 and 64 requests submitted together.
Each figure is the best of `--repeats` runs, and the runs of the systems being compared are
interleaved so that machine noise hits them alike. Compare ratios, not absolute numbers.

    python benchmarks/engine_throughput.py [--max-tokens 128] [--concurrency 1,4,16,64]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from engine import LLM, SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "Explain in simple words how vaccines train the immune system.",
    "List ten ideas for a rainy weekend with children, one per line:",
    "The history of the printing press begins",
    "Q: Why is the sky blue?\nA:",
    "Translate to German: The train leaves at seven in the morning.",
    "class Matrix:\n    def __init__(self, rows):\n",
]


def _best(fn, repeats: int) -> float:
    return min(_timed(fn) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours_runner(llm: LLM, prompt: str):
    """Returns run(n): generate n tokens, batch 1, greedy."""
    def run(num_tokens: int) -> None:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompt, params)
    return run


def transformers_runner(model, tokenizer, prompt: str):
    import torch

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]

    def run(num_tokens: int) -> None:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                           do_sample=False)
    return run


def decode_rates(runners: dict, max_tokens: int, repeats: int) -> dict[str, float]:
    """Output tokens/s after the first token (prefill excluded), batch 1, for each runner.

    The runners take turns within every repetition, so a noisy spell on this shared machine
    hits them alike; each keeps its best full run and its best prefill-only run.
    """
    full = {name: float("inf") for name in runners}
    prefill = dict(full)
    for _ in range(repeats):
        for name, run in runners.items():
            full[name] = min(full[name], _timed(lambda: run(max_tokens)))
            prefill[name] = min(prefill[name], _timed(lambda: run(1)))
    return {name: (max_tokens - 1) / (full[name] - prefill[name]) for name in runners}


def aggregate_rate(llm: LLM, concurrency: int, max_tokens: int, repeats: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(concurrency)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return concurrency * max_tokens / _best(lambda: llm.generate(prompts, params), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--speculative-method", default="none",
                        help="none (default) measures the plain engine core")
    args = parser.parse_args()

    import torch

    llm = LLM(max_num_seqs=64, speculative_method=args.speculative_method)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    result = {
        "model": llm.engine.model_name,
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "speculative_method": args.speculative_method,
        "machine": platform.processor() or platform.machine(),
    }
    runners = {"specserve": ours_runner(llm, PROMPTS[0])}
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(llm.engine.model_folder,
                                                        dtype=torch.float32).eval()
        runners["transformers_generate"] = transformers_runner(hf_model, llm.tokenizer,
                                                               PROMPTS[0])
    rates = decode_rates(runners, args.max_tokens, args.repeats)
    decode = {name: round(rate, 2) for name, rate in rates.items()}
    if "transformers_generate" in rates:
        decode["speedup"] = round(rates["specserve"] / rates["transformers_generate"], 2)
    result["batch1_decode_tokens_per_s"] = decode
    runners.clear()
    rates = {}
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        rates[str(concurrency)] = round(
            aggregate_rate(llm, concurrency, args.max_tokens, args.repeats), 2)
    result["aggregate_output_tokens_per_s"] = rates
    if "1" in rates:
        result["aggregate_vs_concurrency_1"] = {
            c: round(r / rates["1"], 2) for c, r in rates.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
