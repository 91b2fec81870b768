"""`specserve train-draft`: its arguments and its run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def add_train_draft_parser(commands) -> None:
    p = commands.add_parser(
        "train-draft", help="train an EAGLE draft head for a model (--speculative-method eagle)",
        description="Builds training data from the target itself (its answers to built-in "
                    "prompts, and Python source on disk), trains a one-layer EAGLE head, and "
                    "writes it to --output for `specserve serve --speculative-method eagle "
                    "--draft-head DIR`. Uses the GPU when there is one.")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded model)")
    p.add_argument("--output", required=True, help="folder to write the head to")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present)")
    p.add_argument("--max-minutes", type=float, default=35.0,
                   help="training time after the data is built (default: %(default)s)")
    p.add_argument("--max-prompts", type=int, default=None,
                   help="use only this many built-in prompts (quick runs)")
    p.add_argument("--disk-code-tokens", type=int, default=30_000,
                   help="tokens of standard-library Python source to add (default: %(default)s)")
    p.add_argument("--work-dir", default=None,
                   help="where the generated texts and training checkpoints are kept; run again "
                        "with the same folder to resume (default: OUTPUT.work)")
    p.add_argument("--last-layer-only", action="store_true",
                   help="the head reads the target's last layer only (EAGLE), not a low, a "
                        "middle and a high one (EAGLE-3, the default)")
    p.add_argument("--architecture", choices=("eagle", "eagle3"), default="eagle",
                   help="eagle: specserve's own head; eagle3: EAGLE-3's head, written in the "
                        "published layout (config.json + model.safetensors) that vLLM and "
                        "SGLang load too (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)


def run_train_draft(args: argparse.Namespace) -> None:
    from training.eagle_train import TrainOptions, train_draft

    logging.basicConfig(level="WARNING")
    options = TrainOptions(max_minutes=args.max_minutes, max_prompts=args.max_prompts,
                           disk_code_tokens=args.disk_code_tokens, seed=args.seed,
                           eagle3=not args.last_layer_only, architecture=args.architecture,
                           work_dir=Path(args.work_dir or f"{args.output.rstrip('/')}.work"))
    try:
        train_draft(args.model, Path(args.output), options, device=args.device,
                    log=lambda line: print(line, flush=True))
    except ValueError as error:
        raise SystemExit(f"specserve train-draft: error: {error}") from None
