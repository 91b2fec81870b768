"""The draft step of a published EAGLE-3 head at the Llama-3.1-8B shape, random weights, with a
32,000-token draft vocabulary (what EAGLE-3 heads for Llama 3 ship) against the full 128,256.

    python -m benchmarks.experiments.eagle3_draft_vocab_cost [--device cpu] [--context 512]
        [--acceptance-lengths 2,2.5,3] [--num-drafts 3] [--output PATH.json]

A draft step is what EagleProposer runs per draft token: the head's layer over one row at
`--context` tokens of its KV, its LM head over the draft vocabulary, the argmax. Speed does not
depend on weight values. The target's step is not run (8B float32 weights do not fit this CPU's
memory): it is projected as its weight bytes at the bandwidth the head's own step reached, so the
projected speedup, mean tokens per step / (1 + K x draft step / target step), is an estimate that
ignores verification's extra rows; the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.architecture import LlamaArchitecture
from engine.models.layers import Linear
from engine.spec_decode.heads_published.eagle3 import Eagle3Head

LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                  max_position_embeddings=8192, tie_word_embeddings=False, qkv_bias=False,
                  o_bias=False, mlp_bias=False, rope_theta=500000.0, rope_scaling=None)
TARGET_PARAMS = 8.03e9  # Llama-3.1-8B
# Steps not timed: the first ones after building a head run ~1.6x slower on this CPU (a 32k
# vocabulary's step measured slower than the full one's with 2 left out).
WARMUP = 6


def draft_step_seconds(draft_vocab: int, device: torch.device, context: int,
                       iters: int) -> tuple[float, int]:
    """(median seconds of one draft step, weight bytes it streams)."""
    target_arch = LlamaArchitecture(**LLAMA31_8B)
    head_arch = LlamaArchitecture(**{**LLAMA31_8B, "num_layers": 1})
    with torch.device("meta"):
        head = Eagle3Head(head_arch, target_arch, (1, 15, 28), draft_vocab)
    head = head.to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
        head.token_ids.copy_(torch.arange(draft_vocab))
    with torch.device("cpu"):
        head.rotary = type(head.rotary)(head.arch).to(device)
    nbytes = sum(m.weight.numel() * 4 for m in head.modules() if isinstance(m, Linear)
                 and m is not head.fc)  # fc runs once per target step, not per draft
    for module in head.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
    block = 16
    blocks = list(range(context // block + 1))
    cache = KVCache(head.arch, len(blocks), block, torch.float32, device)
    meta = build_attention_metadata([1], [context], [blocks], block, device)
    features = torch.randn(1, 4096, device=device)
    embeds = torch.randn(1, 4096, device=device)
    position = torch.tensor([context - 1], device=device)
    timings = []
    for _ in range(iters + WARMUP):
        start = time.perf_counter()
        head.draft_logits(head(features, embeds, position, cache, meta)).argmax().item()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings[WARMUP:]), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--num-drafts", type=int, default=3)
    parser.add_argument("--acceptance-lengths", default="2,2.5,3",
                        help="mean tokens per verify step to project with (pass the head "
                             "authors' figure for chain drafting at --num-drafts)")
    parser.add_argument("--output")
    args = parser.parse_args()
    device = torch.device(args.device)
    measured = {v: draft_step_seconds(v, device, args.context, args.iters)
                for v in (32000, 128256)}
    # One target step for both: its weight bytes at the best bandwidth a head step reached.
    bandwidth = max(nbytes / seconds for seconds, nbytes in measured.values())
    target_seconds = TARGET_PARAMS * 4 / bandwidth
    cells = {}
    for draft_vocab, (seconds, nbytes) in measured.items():
        ratio = seconds / target_seconds
        cells[draft_vocab] = {
            "draft_step_ms": round(seconds * 1e3, 3), "weight_mb": round(nbytes / 1e6, 1),
            "effective_gb_per_s": round(nbytes / seconds / 1e9, 2),
            "draft_over_target": round(ratio, 4),
            "projected_speedup": {tau: round(float(tau) / (1 + args.num_drafts * ratio), 3)
                                  for tau in args.acceptance_lengths.split(",")},
        }
    report = {"machine": _cpu_name(), "device": str(device),
              "threads": torch.get_num_threads(), "dtype": "float32", "context": args.context,
              "num_drafts": args.num_drafts,
              "projected_target_step_ms": round(target_seconds * 1e3, 1), "draft_vocab": cells,
              "draft_step_32k_over_full": round(cells[32000]["draft_step_ms"]
                                                / cells[128256]["draft_step_ms"], 3),
              "note": "target step projected from weight bytes at the head's own bandwidth; "
                      "verification's extra rows not priced"}
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.machine()
    except OSError:
        return platform.machine()


if __name__ == "__main__":
    main()
