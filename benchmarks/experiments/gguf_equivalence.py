"""Greedy output of the native GGUF engine vs transformers generate() on the dequantized float32
weights, for every prompt of the bundled code, copy and chat sets.

Ours: all prompts in one continuous batch (the path a loaded server takes), speculation off.
Reference: transformers generate(), one prompt at a time, greedy, EOS ignored, on the same GGUF
file dequantized to float32. For a prompt whose tokens differ, the report names the first
divergent position and transformers' top-2 logit margin there (its own logits over the common
prefix): float32 summation order differs between the two, so only a near-tie may flip.

    python -m benchmarks.experiments.gguf_equivalence [--max-tokens 32] [--output FILE.json]

Figures: docs/performance/vs-llamacpp.md (our GGUF dequantization against llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.models.loader import resolve_model_folder
from specserve.bench.report import emit
from specserve.bench.workloads import KINDS, encode, load_workloads


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return position
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def logit_gap(model, prompt_ids: list[int], generated: list[int], position: int,
              ours: int) -> dict:
    """transformers' own logits at `position` (over the common prefix): its top-2 gap, and how far
    our token's logit lies below its choice's. A flip is a near-tie when that gap is small."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + generated[:position]])
        logits = model(ids).logits[0, -1].float()
    top = logits.topk(2).values
    return {"top2_margin": float(top[0] - top[1]),
            "ours_below_theirs": float(logits[generated[position]] - logits[ours])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=1000, help="per kind (default: all)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(speculative_method="none", quantization="gguf-exact")
    folder, _ = resolve_model_folder(None)
    reference_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # EOS ignored on both sides. (min_new_tokens would not do: it masks EOS's logit, so where
    # EOS is the model's greedy choice transformers would pick its runner-up and we would not.)
    reference_model.generation_config.eos_token_id = None
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    results, started = [], time.time()
    for kind in KINDS:
        workloads = load_workloads(kind, args.num_prompts)
        prompts = [encode(llm.tokenizer, w) for w in workloads]
        outputs = llm.generate(prompts, greedy)
        for workload, prompt_ids, output in zip(workloads, prompts, outputs):
            with torch.inference_mode():
                sequence = reference_model.generate(
                    torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=args.max_tokens,
                    pad_token_id=0)[0, len(prompt_ids):].tolist()
            ours = list(output.token_ids)
            position = first_divergence(ours, sequence)
            record = {"id": workload.id, "equal": position is None}
            if position is not None:
                record.update(first_divergent_position=position, ours=ours[position],
                              transformers=sequence[position],
                              **logit_gap(reference_model, prompt_ids, sequence, position,
                                          ours[position]))
            results.append(record)
            print(json.dumps(record), file=sys.stderr)
    mismatches = [r for r in results if not r["equal"]]
    report = {
        "what": "greedy tokens, native GGUF engine (batched) vs transformers generate() on the "
                "dequantized float32 weights",
        "max_tokens": args.max_tokens,
        "num_prompts": len(results),
        "num_equal": len(results) - len(mismatches),
        "mismatches": mismatches,
        "seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    emit(report, args.output)


if __name__ == "__main__":
    main()
