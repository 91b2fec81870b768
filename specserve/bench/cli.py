"""`specserve bench serve | offline | plot`: the arguments, and the dispatch to the module that runs
each. Importing this module is cheap: torch and the engine load only for `offline`."""

from __future__ import annotations

import argparse
import os

from specserve.bench.load import ENDPOINTS
from specserve.bench.workloads import KINDS, SERVE_KINDS

OUR_METHODS = ("none", "ngram", "layer-skip", "draft")
HF_MODES = ("plain", "pld", "assistant")


def add_bench_parser(commands) -> None:
    """Adds `bench` and its subcommands to the `specserve` command's subparsers."""
    bench = commands.add_parser("bench", help="benchmark a server or the engine",
                                description="Benchmarks with JSON results and PNG figures.")
    tools = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_arguments(tools.add_parser(
        "serve", help="load-test any OpenAI-compatible server",
        description="Streams requests to one or more OpenAI-compatible servers at fixed "
                    "concurrencies or Poisson rates and reports throughput, TTFT, TPOT, ITL and "
                    "latency (vllm bench serve's definitions), plus acceptance from /metrics."))
    add_offline_arguments(tools.add_parser(
        "offline", help="speculation methods vs transformers generate(), in one process",
        description="Our engine with each speculation method against no speculation and "
                    "transformers generate() (plain, prompt lookup, assistant model), batch 1, "
                    "greedy, per workload kind."))
    plot = tools.add_parser("plot", help="draw the figure of saved reports",
                            description="Draws serve reports side by side, or one offline report.")
    plot.add_argument("reports", nargs="+", help="JSON files written by --output")
    plot.add_argument("--output", required=True, help="PNG file to write")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", action="append",
                   help="server to test, e.g. http://127.0.0.1:8000; repeat to compare servers "
                        "side by side (default: http://127.0.0.1:8000)")
    p.add_argument("--label", action="append",
                   help="name of each --base-url's run in tables and figures (default: host:port)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (env OPENAI_API_KEY)")
    p.add_argument("--endpoint", default="auto", choices=ENDPOINTS,
                   help="auto: code prompts to /v1/completions, the others to "
                        "/v1/chat/completions (default: %(default)s)")
    p.add_argument("--workload", type=_names(SERVE_KINDS), default=list(KINDS),
                   help=f"bundled prompt sets, each measured on its own: "
                        f"{', '.join(SERVE_KINDS)} (default: {','.join(KINDS)})")
    p.add_argument("--dataset", default=None,
                   help="JSON-lines file of {\"prompt\": ...} objects, instead of --workload")
    p.add_argument("--num-prompts", type=_positive(int), default=32,
                   help="requests per workload and load level (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive(int), default=128,
                   help="max_tokens of every request (default: %(default)s)")
    p.add_argument("--temperature", type=_at_least(float, 0), default=0.0,
                   help="sampling temperature (default: %(default)s, greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max_tokens every time (vLLM's ignore_eos extension)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt order, Poisson arrivals and sampling")
    p.add_argument("--concurrency", type=_list(_positive(int)), default=[1],
                   help="comma-separated concurrency caps to sweep, e.g. 1,4,16,64 "
                        "(default: %(default)s)")
    p.add_argument("--request-rate", type=_list(_positive(float)), default=[float("inf")],
                   help="comma-separated Poisson request rates (requests/s) to sweep; inf sends "
                        "at once, up to the concurrency cap (default: inf)")
    p.add_argument("--duration", type=_positive(float), default=None,
                   help="seconds each workload and load level runs, prompts cycling (a soak "
                        "run; the server's memory and KV usage are sampled), instead of one "
                        "pass over --num-prompts")
    p.add_argument("--disconnect-fraction", type=_fraction, default=0.0,
                   help="share of clients that hang up at a random moment; they are counted "
                        "as client_disconnects, not failures (default: %(default)s)")
    p.add_argument("--disconnect-within", type=_positive(float), default=5.0,
                   help="a hanging-up client leaves within this many seconds of sending "
                        "(default: %(default)s)")
    p.add_argument("--hostile-rate", type=_at_least(float, 0), default=0.0,
                   help="hostile structured-output bodies a second sent beside each run (huge "
                        "or unrunnable schemas, regexes, choices), each expected to be a quick "
                        "400; reported under `hostile` (default: none)")
    p.add_argument("--timeout", type=_positive(float), default=600.0,
                   help="seconds one request may take (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for CI logs)")
    p.add_argument("--keep-texts", action="store_true",
                   help="keep each answer's text in the report beside its digest (`outputs`), "
                        "to diff two servers' outputs token by token")
    p.add_argument("--output", default=None, help="write the JSON report here too")
    p.add_argument("--plot", default=None,
                   help="PNG figure to write (default: the --output path with .png)")
    p.add_argument("--compare", nargs="+", default=None, metavar="REPORT",
                   help="earlier serve reports to draw beside this run")


def add_offline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workload", type=_names(KINDS), default=list(KINDS),
                   help=f"prompt sets (default: {','.join(KINDS)})")
    p.add_argument("--methods", type=_names(OUR_METHODS), default=list(OUR_METHODS),
                   help=f"our speculation methods (default: {','.join(OUR_METHODS)})")
    p.add_argument("--hf-modes", type=_names(HF_MODES), default=list(HF_MODES),
                   help=f"transformers generate() modes, '' for none "
                        f"(default: {','.join(HF_MODES)})")
    p.add_argument("--num-prompts", type=_positive(int), default=4,
                   help="prompts per workload (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive(int), default=128,
                   help="new tokens per prompt, EOS ignored (default: %(default)s)")
    p.add_argument("--repeats", type=_positive(int), default=1,
                   help="runs per prompt and system, the best one counts (default: %(default)s)")
    p.add_argument("--draft-model-layers", type=_positive(int), default=6,
                   help="layers of the truncated target used as draft / assistant model")
    p.add_argument("--concurrency", type=_at_least(int, 0), default=16,
                   help="requests of the batched ngram-vs-none comparison; 0 skips it")
    p.add_argument("--output", default=None, help="write the JSON report here too")
    p.add_argument("--plot", default=None,
                   help="PNG bar chart to write (default: the --output path with .png)")


def run_bench(args: argparse.Namespace) -> None:
    if args.bench_command == "serve":
        from specserve.bench import serve

        serve.run(args)
    elif args.bench_command == "offline":
        from specserve.bench import offline

        offline.run(args)
    else:
        from specserve.bench.report import draw, load_report

        draw([load_report(path) for path in args.reports], args.output)


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown[0]!r}; choose from {', '.join(allowed)}")
        return names
    return parse


def _at_least(kind, minimum, strictly: bool = False):
    """A parser of numbers >= minimum (> minimum when `strictly`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > minimum or (value == minimum and not strictly)):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strictly else '>='} {minimum}, got {text}")
        return value
    return parse


def _fraction(text: str) -> float:
    value = _at_least(float, 0)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be <= 1, got {text}")
    return value


def _positive(kind):
    return _at_least(kind, 0, strictly=True)


def _list(parse_one):
    def parse(text: str) -> list:
        values = [parse_one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse
