"""Suffix decoding against ngram and none on agentic and repetitive traffic, through the server.

    PYTHONPATH=. python -m benchmarks.agentic --output benchmarks/results/agentic_<cpu>.json \
        [--concurrency 16] [--llama-server PATH [--llama-server-plain]] [--plot FIGURE.png]

One `specserve serve` per method (the default model, defaults otherwise), all started first. At
batch 1 they are fed the same turns, the methods taking turns on every request (whoever goes
first on a machine runs a little slower); at `--concurrency N` the episodes go in waves of N,
every method running a wave (N episodes in flight) before the next, the method going first
rotating per wave (benchmarks/agentic_run.py). `--rounds R` draws the workloads R times (seed,
seed + 1, ...) and sums over them. With
`--llama-server`, llama.cpp's own server with its n-gram cache runs beside ours
(benchmarks/agentic_servers.py). Workloads (benchmarks/agentic_workloads.py): an agent
loop re-sending its history, one template over different inputs, one prompt repeated at T = 0
and at T = 0.7 (seeded), and fresh chat as the control. Per workload and method: completion
tokens per second (at batch 1 over the requests' latencies, at concurrency N over the sum of
the waves' wall times), acceptance from `usage.speculative` (llama-server's `timings` draft counts), and
suffix's tokens/s over every other target's. Greedy and seeded outputs of our methods must agree
(lossless; llama.cpp's numerics differ); the report says whether they did. Each server gets
one untimed request first; its seconds, and each server's start to healthy (its own warm-up
included), are reported apart. On a GPU our servers split the card's memory between them
(benchmarks/agentic_servers.py `gpu_share_args`). The machine's load
(`uptime`) is recorded before and after. `--plot` draws the report (benchmarks/agentic_plot.py).
`--baseline REF` also serves `--baseline-methods` from REF checked out beside this tree (labelled
`<method>-baseline`, their outputs held to ours), and reports each method's tokens/s over its
baseline's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from benchmarks.agentic_run import (Chat, Target, TurnRecord, http_chat, over_baseline,
                                    renumbered, run_in_waves, run_interleaved, summarize)
from benchmarks.agentic_offline import (OFFLINE_URL, OfflineEngines, offline_targets,
                                       server_over_offline)
from benchmarks.agentic_servers import (gpu_share_args, serves_on_gpu, start_all,
                                        warm_up_targets)
from benchmarks.agentic_workloads import (DEFAULT_REPEATS, WORKLOAD_NAMES,
                                          Workload, all_workloads,
                                          select_workloads)
from benchmarks.machine import baseline_tree, cpu_model, our_versions
from specserve.bench.report import emit

METHODS = ("none", "ngram", "suffix", "auto")


def run_workload(workload: Workload, targets: list[Target], chat: Chat, concurrency: int,
                 workload_index: int) -> tuple[list[TurnRecord], dict[str, float] | None]:
    """Batch 1: interleaved per request. Concurrency N: in waves of N episodes, whoever goes
    first rotating per wave from the workload's index. (Records, wall seconds per target, or
    None at batch 1.)"""
    if concurrency == 1:
        return run_interleaved(workload, targets, chat), None
    return run_in_waves(workload, targets, chat, concurrency, workload_index)


def run_rounds(rounds: list[list[Workload]], targets: list[Target], chat: Chat,
               concurrency: int) -> dict:
    """Every round's workloads in turn (a round: the workloads drawn with one seed), each
    workload's records and wall times summed over the rounds, then summarized."""
    records: dict[str, list] = {}
    walls: dict[str, dict[str, float]] = {}
    episodes: dict[str, int] = {}
    for round_index, workloads in enumerate(rounds):
        for index, workload in enumerate(workloads):
            mine, wall = run_workload(workload, targets, chat, concurrency,
                                      round_index + index)
            offset = episodes.get(workload.name, 0)
            records.setdefault(workload.name, []).extend(renumbered(mine, offset))
            episodes[workload.name] = offset + len(workload.episodes)
            for label, seconds in (wall or {}).items():
                walls.setdefault(workload.name, {}).setdefault(label, 0.0)
                walls[workload.name][label] += seconds
            print(f"round {round_index}, {workload.name}: done", file=sys.stderr)
    # fewer episodes than --concurrency: never that many in flight (raise --scale, --repeats)
    return {name: {"episodes": episodes[name],
                   **over_baseline(summarize(found, targets, walls.get(name)))}
            for name, found in records.items()}


def answer(target: Target, system, messages, turn, offline: OfflineEngines, max_tokens: int):
    """A turn to a server over HTTP, or to an engine in this process."""
    if target.url.startswith(OFFLINE_URL):
        return offline.chat(target, system, messages, turn, max_tokens)
    return http_chat(target, system, messages, turn, max_tokens)


# `specserve serve` flags the offline engines take too (the rest are the server's own)
SHARED_FLAGS = {"--model": ("model", str), "--dtype": ("dtype", str),
                "--device": ("device", str), "--max-model-len": ("max_model_len", int)}


def offline_engine_options(server_args: list[str], num_engines: int) -> dict:
    """The servers' model, dtype, device and context as LLM options, and on a GPU the offline
    engines' share of the card, as the servers have theirs."""
    options = {}
    for flag, value in zip(server_args, server_args[1:]):
        if flag in SHARED_FLAGS:
            name, kind = SHARED_FLAGS[flag]
            options[name] = kind(value)
    share = gpu_share_args(server_args, num_engines, serves_on_gpu(server_args))
    if share:
        options["gpu_memory_utilization"] = float(share[1])
    return options


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default all)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scale", type=int, default=1, help="episodes per workload, x")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="how often the repeated prompts are sent")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="episodes in flight at once (1: batch 1, methods interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the workloads this often, drawn afresh each round (seed + "
                             "round), and report the sums: more requests against the noise")
    parser.add_argument("--server-args", default="", help="more `specserve serve` flags")
    parser.add_argument("--offline", default="", metavar="METHODS",
                        help="also answer every turn with the engine offline (an LLM in this "
                             "process) for these methods: <method>_over_offline in the report")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary: compare with its --spec-type ngram-cache")
    parser.add_argument("--llama-server-plain", action="store_true",
                        help="also llama-server without speculation")
    parser.add_argument("--llama-server-threads", type=int, default=2)
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="also serve --baseline-methods from this commit (a git worktree)")
    parser.add_argument("--baseline-methods", default="none,suffix")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--cpu-note", default=None, help="what to say of the CPU beside its name")
    parser.add_argument("--output", default=None)
    parser.add_argument("--plot", default=None, metavar="PATH.png",
                        help="draw tokens/s and acceptance per workload (benchmarks/agentic_plot)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.rounds < 1:
        parser.error(f"--concurrency and --rounds must be >= 1, got {args.concurrency} and "
                     f"{args.rounds}")
    if args.offline and args.concurrency > 1:
        parser.error("--offline runs at batch 1 only (one LLM answers one turn at a time)")
    if args.llama_server_plain and not args.llama_server:
        parser.error("--llama-server-plain needs --llama-server PATH")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        rounds = [select_workloads(all_workloads(args.seed + round_index, args.scale,
                                                 args.repeats),
                                   args.workloads.split(",") if args.workloads else None)
                  for round_index in range(args.rounds)]
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.plot:
        from specserve.bench.plots import load_pyplot

        load_pyplot()  # no matplotlib: say so now, not after the run
    load_before = _load()
    with ExitStack() as stack:
        tree = stack.enter_context(baseline_tree(args.baseline))
        baseline = (tree, stack.enter_context(tempfile.TemporaryDirectory()),
                    args.baseline_methods.split(",")) if tree else None
        offline_methods = [m for m in args.offline.split(",") if m]
        servers = start_all(args.methods.split(","), args.server_args.split(),
                            Path(args.log_dir), args.llama_server, args.llama_server_plain,
                            args.llama_server_threads, args.concurrency, baseline,
                            num_other_engines=len(offline_methods))
        warmup_seconds = warm_up_targets(servers.targets, args.max_tokens)
        targets, chat = servers.targets, partial(http_chat, max_tokens=args.max_tokens)
        if offline_methods:
            offline = OfflineEngines(offline_methods,
                                     offline_engine_options(
                                         args.server_args.split(),
                                         sum(t.ours for t in servers.targets)
                                         + len(offline_methods)))
            targets = targets + offline_targets(offline_methods)
            chat = partial(answer, offline=offline, max_tokens=args.max_tokens)
        results = run_rounds(rounds, targets, chat, args.concurrency)
        for result in results.values():
            result.update(server_over_offline(result))
        servers.stop()
    report = {"benchmark": "agentic", "cpu": cpu_model(), "cpu_note": args.cpu_note,
              "versions": our_versions(), "batch": 1 if args.concurrency == 1 else None,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "scale": args.scale, "repeats": args.repeats, "seed": args.seed,
              "rounds": args.rounds, "baseline": args.baseline,
              "server_args": args.server_args, "servers": servers.commands,
              "server_start_seconds": servers.start_seconds, "warmup_seconds": warmup_seconds,
              "load_before": load_before, "load_after": _load(), "workloads": results}
    emit(report, args.output)
    if args.plot:
        from benchmarks.agentic_plot import plot_agentic

        plot_agentic(report, args.plot)
        print(f"figure written to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
