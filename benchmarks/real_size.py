"""A real-size model without downloads: a Llama-3-8B-shaped model (or any config JSON) with random
weights, built on the device, its decode/verify step timed against the memory-bandwidth limit.

    python -m benchmarks.real_size [--config llama3-8b|PATH.json] [--rows 1,2,4,8,16]
        [--verify-rows 8] [--acceptance spec_matrix.json]

Speed does not depend on weight values, so random weights time what a served 8B model would.
Each step is the engine's own padded step (StaticStepRunner: CUDA graph replay on a GPU, then the
LM head on every row), timed with device events over `--iters` replays at a context of
`--context` tokens per sequence:
- decode: `--rows` sequences of one token each;
- verify: one sequence of `--verify-rows` tokens (its last token and drafts), what speculation
  pays per step at batch 1.
The limit is weight bytes / the device's measured copy bandwidth (bytes read plus written by a
large device-to-device copy): no step can read every weight faster.

With `--acceptance` (a spec_matrix JSON measured on a real small model), a projected speedup per
method and workload: mean tokens per verify step x t(1 row) / t(1 + K rows), K the method's
drafts per step priced as the widest verify measured, drafting itself not counted (n-gram's lookup is host time that overlap hides).
Prints JSON; `--output` writes it too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.machine import device_facts
from specserve.bench.report import emit

LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False}


def build_model(config: dict, device: torch.device, dtype: torch.dtype):
    """Our Llama model of this config, random weights (normal, std 0.02), on `device`."""
    from transformers import AutoConfig

    from engine.models.architecture import LlamaArchitecture
    from engine.models.llama import LlamaForCausalLM

    arch = LlamaArchitecture.from_hf_config(AutoConfig.for_model("llama", **config))
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device).to(dtype).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():  # norms at one, as trained models roughly have them
            if type(module).__name__ == "RMSNorm":
                module.weight.fill_(1.0)
    model.build_rotary(device)
    return model


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a large device copy moves, reads plus writes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = timed(lambda: dst.copy_(src), device, iters=10)
    return 2 * nbytes / seconds


def timed(function, device: torch.device, iters: int) -> float:
    """Seconds per call, the median of `iters` calls after two warm-ups."""
    for _ in range(2):
        function()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            function()
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def step_seconds(runner, num_seqs: int, query_len: int, context: int, iters: int) -> float:
    """One padded step of `num_seqs` sequences feeding `query_len` tokens each at `context`
    tokens of context, every row's logits computed; each sequence owns its own blocks."""
    from engine.runner.static_runner import StaticStep, StepShape, bucket_for, power_of_two_bucket

    bs = runner.block_size
    blocks_per_seq = -(-context // bs)
    width = runner.max_blocks if runner.full_width_tables \
        else power_of_two_bucket(blocks_per_seq, runner.max_blocks)
    shape = StepShape(bucket_for(num_seqs, runner.buckets),
                      power_of_two_bucket(query_len, runner.max_query_len), width)
    b, q = shape.num_seqs, shape.query_len
    device = runner.device
    seq = torch.arange(b, device=device).repeat_interleave(q)
    pos = (context - q) + torch.arange(q, device=device).repeat(b)
    tables = seq.new_tensor(range(b * blocks_per_seq)).view(b, blocks_per_seq)
    runner.input_ids[:b * q].random_(0, 1000)
    runner.feed_index[:b * q].copy_(torch.arange(b * q, device=device) + runner.max_seqs)
    runner.positions[:b * q].copy_(pos)
    runner.slot_mapping[:b * q].copy_(tables[seq, pos // bs] * bs + pos % bs)
    runner.block_tables[:b, :blocks_per_seq].copy_(tables)
    runner.query_lens[:b].fill_(q)
    runner.context_lens[:b].fill_(context)
    rows = torch.arange(num_seqs * q, device=device)
    step = StaticStep(shape, rows, list(range(num_seqs)), [i * q for i in range(num_seqs)],
                      [i * q for i in range(num_seqs)])
    return timed(lambda: runner.run(step), device, iters)


def projection(acceptance: dict, t1_ms: float, verify_ms: float) -> dict:
    """Per method and workload of a spec_matrix report: projected speedup on this model, each
    verify step priced as the widest one measured (conservative: the controller often sends
    fewer drafts)."""
    out = {}
    for workload, methods in acceptance.get("batch1", {}).get("0.0", {}).items():
        for method, cell in methods.items():
            length = cell.get("mean_acceptance_length")
            if method == "none" or not length:
                continue
            out.setdefault(method, {})[workload] = {
                "mean_acceptance_length": length,
                "projected_speedup": round(length * t1_ms / verify_ms, 3),
                "measured_on_small_model": cell.get("ratio_vs_none")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--verify-rows", default="2,4,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the row-invariant products (engine/models/invariant_linear.py)")
    parser.add_argument("--fused-kernels", default="auto", choices=["auto", "off"],
                        help="the layers' fused decode/verify kernels (engine/models/"
                             "fused_layer.py), as the engine's option")
    parser.add_argument("--acceptance", help="a spec_matrix JSON to project speedups from")
    parser.add_argument("--output")
    args = parser.parse_args()
    from engine.core.device import DTYPES, pick_device
    from engine.core.kv_cache import KVCache
    from engine.runner.static_runner import StaticStepRunner

    device, dtype = pick_device(None), DTYPES[args.dtype]
    config = LLAMA3_8B if args.config == "llama3-8b" else json.loads(Path(args.config).read_text())
    model = build_model(config, device, dtype)
    model.set_attention_backend(args.attention_backend)
    if args.batch_invariant:
        model.use_batch_invariant_kernels(device, dtype, args.attention_backend)
    fused_layers = model.use_fused_kernels(args.fused_kernels, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = [int(r) for r in args.rows.split(",")]
    verify_rows = [int(r) for r in args.verify_rows.split(",")]
    max_seqs, max_query = max(rows), max(verify_rows)
    block_size = 16
    blocks = max_seqs * -(-args.context // block_size)
    kv_cache = KVCache(model.arch, blocks + 1, block_size, dtype, device)
    runner = StaticStepRunner(model, kv_cache, block_size, scratch_block=blocks,
                              max_num_seqs=max_seqs, max_query_len=max_query,
                              max_model_len=args.context + max_query, device=device,
                              use_graphs=True,
                              full_width_tables=args.attention_backend == "triton")
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    limit_ms = None if bandwidth is None else 1e3 * weight_bytes / bandwidth

    def cell(seconds: float) -> dict:
        ms = 1e3 * seconds
        return {"ms": round(ms, 4),
                "over_bandwidth_limit": None if limit_ms is None else round(ms / limit_ms, 3)}

    decode = {str(n): cell(step_seconds(runner, n, 1, args.context, args.iters)) for n in rows}
    verify = {str(n): cell(step_seconds(runner, 1, n, args.context, args.iters))
              for n in verify_rows}
    report = {
        "benchmark": "real_size", "date": time.strftime("%Y-%m-%d"), **device_facts(device),
        "config": {"model": args.config, "dtype": args.dtype, "context": args.context,
                   "batch_invariant": args.batch_invariant,
                   "fused_kernels": args.fused_kernels, "fused_layers": fused_layers,
                   "iters": args.iters, "attention_backend": args.attention_backend,
                   "graphs": runner.graphs.enabled, "weights": "random (normal, std 0.02)"},
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_limit_ms": None if limit_ms is None else round(limit_ms, 4),
        "decode_rows": decode,
        "verify_one_sequence_rows": verify,
        "verify_over_one_row": {n: round(v["ms"] / decode["1"]["ms"], 3)
                                for n, v in verify.items()} if "1" in decode else None,
    }
    if args.acceptance:
        report["projected"] = projection(json.loads(Path(args.acceptance).read_text()),
                                         decode[str(rows[0])]["ms"],
                                         verify[str(max(verify_rows))]["ms"])
    emit(report, args.output)


if __name__ == "__main__":
    main()
