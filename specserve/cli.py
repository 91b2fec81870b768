"""specserve: an OpenAI-compatible LLM server with lossless speculative decoding."""

from __future__ import annotations

import argparse

from specserve.bench.cli import add_bench_parser, run_bench
from server.cli import add_serve_parser, run_serve
from training.cli import add_train_draft_parser, run_train_draft


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_bench_parser(commands)
    add_train_draft_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        try:
            run_bench(args)
        except ValueError as error:
            raise SystemExit(f"specserve bench: error: {error}") from None
    elif args.command == "train-draft":
        run_train_draft(args)
    else:
        run_serve(args)
