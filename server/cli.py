"""specserve: an OpenAI-compatible LLM server with lossless speculative decoding."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from engine.config import QUANTIZATION_NAMES, EngineConfig
from engine.core_process.selection import ENGINE_CORE_CHOICES
from server import templates
from server.connections import DEFAULT_HEADER_TIMEOUT_S
from server.context import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_ENGINE_STEP_TIMEOUT_S,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STREAM_STALL_TIMEOUT_S,
)
from server.speculative_flags import add_speculative_arguments, with_speculative_config


def add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, "
                    "/detokenize, /health, /version, /metrics).")
    add_serve_arguments(serve)


def build_parser() -> argparse.ArgumentParser:
    """The `serve` command alone (`specserve`'s other commands: specserve/cli.py)."""
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="model name clients must send")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_NAMES,
                   help="auto: a .gguf model on CPU keeps its 4/8-bit blocks and runs on native "
                        "kernels, other models and devices use float weights; gguf-exact: insist "
                        "on native blocks, float32 activations (equal to transformers on the "
                        "dequantized weights); gguf: the same today; none: dequantize to float "
                        "weights (default: %(default)s)")
    add_speculative_arguments(p)
    p.add_argument("--engine-core", default="auto", choices=ENGINE_CORE_CHOICES,
                   help="where the engine steps: 'thread' (in the server's process), 'process' "
                        "(a process of its own; the server tokenizes and streams); 'auto' "
                        "(default): process on CUDA (measured faster there), thread on CPU")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (longer prompts prefill in chunks)")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size in GiB (default: 1 on CPU; on a GPU what "
                        "--gpu-memory-utilization leaves after weights and activations)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's total memory this server may use: weights, "
                        "activations and KV cache (default: %(default)s)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap: launch the next decode step before reading this one's tokens "
                        "(plain decode steps, and with ngram or suffix the steps after ones "
                        "without drafts; default: on for CUDA unless a draft model or head "
                        "must see every step, off on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode and verify steps launch their kernels one by one")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="decode/verify attention: 'torch' gathers KV pages and calls SDPA; "
                        "'triton' reads the block table in one kernel; 'auto' (default): "
                        "triton on CUDA where it is installed, torch elsewhere")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N ranks (processes this server starts; NCCL with "
                        "one GPU each, gloo on CPU): N must divide the attention heads, and "
                        "divide or be a multiple of the KV heads (docs/multi-gpu.md)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="compute each row of a step bitwise as alone (GPU: Triton products for "
                        "steps of at most 64 rows), so bfloat16 speculation gives exactly the "
                        "non-speculative tokens; costs GPU time (docs/gpu.md)")
    p.add_argument("--fused-kernels", default="off", choices=["auto", "off"],
                   help="decode/verify steps of plain Llama layers in five fused Triton kernels "
                        "a layer on CUDA (bf16/fp16, <= 64 rows) where 'auto'; 'off': the torch "
                        "path (default: %(default)s until measured on a GPU)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting for their first token beyond which new ones get 503 "
                        "with Retry-After, and /ready fails (default: %(default)s)")
    p.add_argument("--max-completions-per-request", type=int, default=None,
                   help="engine requests (prompts x n) one request may ask for; more is a 400 "
                        "(default and most: --max-queue)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection may take to send its request headers, from when "
                        "it opens or its previous response ends; then it is closed "
                        "(default: %(default)s)")
    p.add_argument("--stream-stall-timeout", type=float, default=DEFAULT_STREAM_STALL_TIMEOUT_S,
                   help="seconds a streaming client may read nothing (its buffers full) before "
                        "its stream is aborted and its KV freed (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; larger ones get 413 "
                        "(default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds in-flight requests get to finish after SIGTERM before they "
                        "are aborted; a second signal exits at once (default: %(default)s)")
    p.add_argument("--engine-step-timeout", type=float, default=DEFAULT_ENGINE_STEP_TIMEOUT_S,
                   help="seconds one engine step may run before /health (liveness) fails "
                        "(default: %(default)s)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template to use instead of the model's: a file's path, or "
                        "the template itself")
    p.add_argument("--chat-template-timeout", type=float, default=templates.DEFAULT_TIMEOUT_S,
                   help="seconds one chat-template rendering may take; a longer one is stopped "
                        "and its request gets a 400 (default: %(default)s)")
    p.add_argument("--chat-template-max-bytes", type=int, default=templates.DEFAULT_MAX_BYTES,
                   help="largest prompt a chat template may render (default: %(default)s)")
    p.add_argument("--chat-template-workers", type=int, default=templates.DEFAULT_WORKERS,
                   help="most processes that render chat templates: one starts with the server, "
                        "more only while renderings wait for one (a stuck template), since each "
                        "costs ~22 MB resident (default: %(default)s)")
    p.add_argument("--metrics-prefix", default="specserve",
                   help="name prefix of the /metrics series; 'vllm' makes dashboards and tools "
                        "built for vLLM work unchanged (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require this bearer token (env SPECSERVE_API_KEY); several keys "
                        "comma-separated, each seeing only its own stored responses")
    p.add_argument("--response-store", default=None, metavar="PATH",
                   help="SQLite file of stored responses (/v1/responses), or :memory: "
                        "(default: responses.sqlite3 under the cache folder)")
    p.add_argument("--response-store-max-mb", type=float, default=1024.0,
                   help="stored responses kept at most, oldest dropped first "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="logging verbosity")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    args = with_speculative_config(args)
    return EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling,
        kv_cache_memory_gib=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, batch_invariant=args.batch_invariant,
        tensor_parallel_size=args.tensor_parallel_size,
        fused_kernels=args.fused_kernels,
        block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
        draft_at_prefill=args.draft_at_prefill, draft_layers=args.draft_layers,
        draft_layer_ids=args.draft_layer_ids, draft_head=args.draft_head,
        eagle_ngram_min=args.eagle_ngram_min, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        suffix_max_depth=args.suffix_max_depth,
        suffix_max_spec_factor=args.suffix_max_spec_factor,
        suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_cache_max_requests=args.suffix_cache_max_requests,
        suffix_cache_max_bytes=args.suffix_cache_max_bytes,
        suffix_cache_scope=args.suffix_cache_scope, suffix_cache_prompts=args.suffix_cache_prompts,
    )


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself where it reads as a template (as
    vLLM takes it)."""
    if value is None or any(mark in value for mark in ("{{", "{%")):
        return value
    try:
        return Path(value).read_text()
    except OSError as error:
        raise ValueError(f"--chat-template: cannot read {value!r}: {error.strerror}") from None


def main(argv: list[str] | None = None) -> None:
    run_serve(build_parser().parse_args(argv))


def run_serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        if args.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
        if args.max_completions_per_request is not None and not \
                1 <= args.max_completions_per_request <= args.max_queue:
            raise ValueError("--max-completions-per-request must be between 1 and --max-queue "
                             f"({args.max_queue}), got {args.max_completions_per_request}")
        for flag, count in (("--max-request-bytes", args.max_request_bytes),
                            ("--chat-template-max-bytes", args.chat_template_max_bytes),
                            ("--chat-template-workers", args.chat_template_workers)):
            if count < 1:
                raise ValueError(f"{flag} must be >= 1, got {count}")
        chat_template = _chat_template(args.chat_template)
        for flag, value in (("--drain-timeout", args.drain_timeout),
                            ("--header-timeout", args.header_timeout),
                            ("--stream-stall-timeout", args.stream_stall_timeout),
                            ("--chat-template-timeout", args.chat_template_timeout),
                            ("--engine-step-timeout", args.engine_step_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if not args.response_store_max_mb > 0:
            raise ValueError("--response-store-max-mb must be > 0, got "
                             f"{args.response_store_max_mb}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", args.metrics_prefix):
            raise ValueError(f"--metrics-prefix must be letters, digits and underscores, got "
                             f"{args.metrics_prefix!r}")
        # Fail before the server starts, with one line, when the model cannot be found or its
        # file is damaged.
        from engine.models.gguf_native import check_gguf
        from engine.models.loader import locate_model

        path, _ = locate_model(config.model.model)
        if path.is_file() and path.suffix == ".gguf":
            check_gguf(path)
    except ValueError as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    from server.app import ServerSettings, build_app
    from server.lifecycle import serve

    settings = ServerSettings(served_model_name=args.served_model_name,
                              api_key=args.api_key or None, max_queue=args.max_queue,
                              max_completions_per_request=args.max_completions_per_request,
                              stream_stall_timeout_s=args.stream_stall_timeout,
                              metrics_prefix=args.metrics_prefix,
                              max_request_bytes=args.max_request_bytes,
                              drain_timeout_s=args.drain_timeout,
                              engine_step_timeout_s=args.engine_step_timeout,
                              chat_template=chat_template,
                              response_store=args.response_store,
                              response_store_max_mb=args.response_store_max_mb,
                              template_limits=templates.TemplateLimits(
                                  args.chat_template_timeout, args.chat_template_max_bytes,
                                  args.chat_template_workers))
    app = build_app(config, settings, engine_core=args.engine_core)
    serve(app, app.state.lifecycle, host=args.host, port=args.port, log_level=args.log_level,
          header_timeout_s=args.header_timeout)


if __name__ == "__main__":
    main()
