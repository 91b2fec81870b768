"""The GPU path against transformers, side by side in one process (issue 11's measurements).

Batch 1, greedy, `--max-tokens` new tokens per prompt (EOS ignored), the prompts of the code /
copy / chat workloads, each prompt timed as the best of `--repeats`, systems taking turns:

  ours/none, ours/ngram          LLM(speculative_method=...), padded steps (CUDA graphs on CUDA
                                 unless --enforce-eager)
  hf/plain, hf/pld               transformers generate(), and with prompt_lookup_num_tokens=10
  hf/static                      generate() with cache_implementation="static" (transformers
                                 compiles the decode step itself; the first call is slow and
                                 is the warm-up)

then every prompt cycled to each `--batch-sizes` entry, in one call each: ours/none, ours/ngram
and transformers' padded batch generate() (left padding). JSON to stdout (and --output).

    python -m benchmarks.gpu_vs_transformers [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.bench.offline import Run, compare_kind, measure_kind, ours
from specserve.bench.workloads import KINDS, encode, load_workloads
from engine import LLM, SamplingParams
from engine.core.device import synchronize
from engine.models.loader import resolve_model_folder


def hf_generate(model, device: torch.device, **options):
    pad = model.generation_config.pad_token_id or model.generation_config.eos_token_id

    def run(prompt_ids: list[int], max_tokens: int) -> Run:
        input_ids = torch.tensor([prompt_ids], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            sequences = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad,
                **options)
        synchronize(device)
        return Run(sequences[0, len(prompt_ids):].tolist(), time.perf_counter() - start)
    return run


def hf_padded_batch(model, tokenizer, device, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens/s of one left-padded batch generate()."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else model.generation_config.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                       max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    synchronize(device)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def ours_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=2, help="per workload kind")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--hf-modes", default="plain,pld,static")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="share of the card for each of our two engines (they run side by "
                             "side in this process, beside transformers)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    folder, model_name = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine_options = dict(device=args.device, dtype=args.dtype, enable_prefix_caching=False,
                          enforce_eager=args.enforce_eager,
                          attention_backend=args.attention_backend,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(
                              [1] + [int(b) for b in args.batch_sizes.split(",") if b]))
    llms = {m: LLM(str(folder), speculative_method=m, **engine_options)
            for m in ("none", "ngram")}
    systems = {f"ours/{m}": ours(llm, m != "none") for m, llm in llms.items()}
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    hf_options = {"plain": {}, "pld": {"prompt_lookup_num_tokens": 10},
                  "static": {"cache_implementation": "static"}}
    for mode in [m for m in args.hf_modes.split(",") if m]:
        systems[f"hf/{mode}"] = hf_generate(hf_model, device, **hf_options[mode])
    prompts = {kind: [encode(tokenizer, w) for w in load_workloads(kind, args.num_prompts)]
               for kind in KINDS}
    warmup = prompts["code"][0]
    for name, system in systems.items():  # compiles, captures graphs, fills caches
        started = time.perf_counter()
        system(warmup, args.max_tokens)
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    results = {name: {} for name in systems}
    for kind in KINDS:
        for name, record in compare_kind(measure_kind(systems, prompts[kind], args.max_tokens,
                                                      args.repeats)).items():
            results[name][kind] = record
    everything = [ids for kind in KINDS for ids in prompts[kind]]
    batches = {}
    for size in [int(b) for b in args.batch_sizes.split(",") if b]:
        batch = [everything[i % len(everything)] for i in range(size)]
        rates = {"ours/none": 0.0, "ours/ngram": 0.0, "hf/padded": 0.0}
        for _ in range(args.repeats):
            rates["ours/none"] = max(rates["ours/none"],
                                     ours_batch(llms["none"], batch, args.max_tokens))
            rates["ours/ngram"] = max(rates["ours/ngram"],
                                      ours_batch(llms["ngram"], batch, args.max_tokens))
            rates["hf/padded"] = max(rates["hf/padded"], hf_padded_batch(
                hf_model, tokenizer, device, batch, args.max_tokens))
        batches[size] = {name: round(rate, 1) for name, rate in rates.items()}
        batches[size]["ours_none_vs_hf_padded"] = round(rates["ours/none"] / rates["hf/padded"], 3)
    report = {
        "benchmark": "gpu_vs_transformers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name, "device": str(device), "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "enforce_eager": args.enforce_eager, "attention_backend": args.attention_backend,
        "max_tokens": args.max_tokens,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "batch_1": results, "batches": batches,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
