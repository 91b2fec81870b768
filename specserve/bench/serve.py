"""`specserve bench serve`: a load generator for any OpenAI-compatible server.

For each workload kind, each load level (a concurrency cap, and/or a Poisson request rate) and
each target server, it sends `num_prompts` streamed requests and summarizes them as
`vllm bench serve` does (serving_metrics.py); it reads the server's /metrics before and after
every run for acceptance figures (server_metrics.py). With several targets (two servers: one
speculating, one not), the targets take turns on every (kind, level), in alternating order, so the
host's drift hits them alike and the ratios between them are fair.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import random
import sys
from dataclasses import dataclass

import httpx

from specserve.bench.hostile import send_hostile
from specserve.bench.load import CANCELLED, Disconnects, RequestOptions, Target, run_load, send
from specserve.bench.report import finish, load_report
from specserve.bench.server_metrics import (
    scrape_spec_counters,
    scrape_timeline,
    speculation_summary,
    timeline_summary,
)
from specserve.bench.server_state import sample_states, scrape_state, state_when_idle
from specserve.bench.serving_metrics import outputs_of, summarize, timeline
from specserve.bench.workloads import Workload, load_dataset, load_workloads

ALL_PROMPTS = 10_000  # more than any bundled set holds
STATE_EVERY_S = 30.0  # server-state samples during a timed (soak) run
WARMUP = Workload("warmup/hello", "warmup", "Say hello.", chat=True)


@dataclass(frozen=True)
class LoadLevel:
    concurrency: int | None  # most requests in flight; None: no cap
    request_rate: float  # requests/s of the Poisson arrivals; inf: all at once


def load_levels(concurrencies: list[int], request_rates: list[float]) -> list[LoadLevel]:
    """Every (concurrency, rate) pair; a rate-only sweep has no concurrency cap."""
    caps: list[int | None] = list(concurrencies) or [None]
    return [LoadLevel(cap, rate) for cap in caps for rate in request_rates]


def sample_workloads(pool: list[Workload], num_prompts: int, seed: int) -> list[Workload]:
    """`num_prompts` prompts drawn from `pool` in a seeded order, cycling when it is smaller."""
    order = list(pool)
    random.Random(seed).shuffle(order)
    return list(itertools.islice(itertools.cycle(order), num_prompts))


def workload_sets(kinds: list[str], dataset: str | None, num_prompts: int,
                  seed: int) -> dict[str, list[Workload]]:
    """The prompts of each run, by kind: the bundled kinds, or the user's dataset as one set."""
    if dataset:
        pools = {"dataset": load_dataset(dataset)}
    else:
        pools = {kind: load_workloads(kind, ALL_PROMPTS) for kind in kinds}
    return {kind: sample_workloads(pool, num_prompts, seed) for kind, pool in pools.items()}


async def resolve_model(client: httpx.AsyncClient, target: Target) -> Target:
    """The target with its model named: the first one /v1/models lists when none was given."""
    if target.model:
        return target
    response = await client.get(f"{target.base_url}/v1/models", headers=target.headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{target.base_url}/v1/models lists no model; pass --model")
    return Target(target.label, target.base_url, models[0]["id"], target.api_key)


@dataclass(frozen=True)
class Soak:
    """A timed run: each (kind, level) lasts `duration_s` (the prompts cycle) instead of one pass
    over `num_prompts`, some clients hang up at random, and the server's memory and KV usage are
    sampled before, during and after."""

    duration_s: float | None = None
    disconnects: Disconnects = Disconnects()
    hostile_rate: float = 0.0  # hostile bodies a second beside the run (specserve/bench/hostile.py)

    @property
    def window_s(self) -> float:
        """The timeline's window: about 60 of them over the run, none under a second."""
        return max(1.0, (self.duration_s or 0.0) / 60)


async def benchmark(targets: list[Target], workloads: dict[str, list[Workload]],
                    levels: list[LoadLevel], options: RequestOptions, seed: int,
                    timeout: float, progress: bool, soak: Soak = Soak(),
                    keep_texts: bool = False) -> list[dict]:
    """One record a target: its identity and one result per (kind, level). A result lists each
    answer's digest (`outputs`; with `keep_texts`, its text too), except in a soak, whose prompts
    cycle for minutes."""
    most_in_flight = max(level.concurrency or len(items)
                         for level in levels for items in workloads.values())
    limits = httpx.Limits(max_connections=most_in_flight + 2, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        targets = [await resolve_model(client, target) for target in targets]
        for target in targets:  # first requests pay one-time costs (connections, lazy init)
            warmup = await send(client, target, WARMUP, RequestOptions(options.endpoint, 8))
            if not warmup.ok:
                raise ValueError(f"{target.base_url}: warm-up request failed: {warmup.error}")
        total = len(targets) * len(levels) * sum(len(items) for items in workloads.values())
        bar = _progress_bar(None if soak.duration_s else total, progress)
        results: dict[str, list[dict]] = {target.label: [] for target in targets}
        turn = 0
        for kind, items in workloads.items():
            for level in levels:
                order = targets if turn % 2 == 0 else targets[::-1]
                turn += 1
                for target in order:
                    bar.set_description(f"{target.label} {kind} c={level.concurrency} "
                                        f"rate={level.request_rate}")
                    before = await scrape_spec_counters(client, target.base_url)
                    timeline_before = await scrape_timeline(client, target.base_url)
                    state_before = await scrape_state(client, target.base_url)
                    states: list[dict] = []
                    sampler = asyncio.create_task(sample_states(
                        client, target.base_url, STATE_EVERY_S, states))
                    hostile: dict = {}
                    attacker = asyncio.create_task(send_hostile(
                        client, target, soak.hostile_rate, hostile)) if soak.hostile_rate else None
                    try:
                        records, duration = await run_load(
                            client, target, itertools.cycle(items) if soak.duration_s else items,
                            options, level.concurrency, level.request_rate, seed,
                            on_done=lambda: bar.update(1), duration_s=soak.duration_s,
                            disconnects=soak.disconnects)
                    finally:
                        sampler.cancel()
                        if attacker is not None:
                            attacker.cancel()
                            await asyncio.gather(attacker, return_exceptions=True)
                    after = await scrape_spec_counters(client, target.base_url)
                    timeline_after = await scrape_timeline(client, target.base_url)
                    # A client's planned hang-up is neither a completion nor a server failure.
                    served = [record for record in records if record.error != CANCELLED]
                    result = {"kind": kind, "max_concurrency": level.concurrency,
                              "request_rate": _rate(level.request_rate),
                              **summarize(served, duration),
                              "client_disconnects": len(records) - len(served),
                              "speculative": speculation_summary(before, after),
                              "server_timeline": timeline_summary(timeline_before,
                                                                  timeline_after)}
                    if attacker is not None:
                        result["hostile"] = hostile
                    if not soak.duration_s:
                        result["outputs"] = outputs_of(served, keep_texts)
                    else:
                        result["timeline"] = timeline(records, soak.window_s, CANCELLED)
                        result["server_state"] = {
                            "before": state_before, "during": states,
                            "after_idle": await state_when_idle(client, target.base_url)}
                    results[target.label].append(result)
        bar.close()
    return [{"label": target.label, "base_url": target.base_url, "model": target.model,
             "results": results[target.label]} for target in targets]


def run(args) -> dict:
    """The whole `bench serve` command: validate, measure, report (JSON, table, figure)."""
    earlier = [load_report(path) for path in args.compare or []]  # fail before, not after
    targets = _targets(args)
    levels = load_levels(args.concurrency, args.request_rate)
    workloads = workload_sets(args.workload, args.dataset, args.num_prompts, args.seed)
    options = RequestOptions(args.endpoint, args.max_tokens, args.temperature, args.seed,
                             args.ignore_eos)
    soak = Soak(args.duration, Disconnects(args.disconnect_fraction, args.disconnect_within),
                args.hostile_rate)
    runs = asyncio.run(benchmark(targets, workloads, levels, options, args.seed, args.timeout,
                                 progress=not args.no_progress, soak=soak,
                                 keep_texts=args.keep_texts))
    report = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"endpoint": args.endpoint, "workloads": list(workloads),
                   "dataset": args.dataset, "num_prompts": args.num_prompts,
                   "max_tokens": args.max_tokens, "temperature": args.temperature,
                   "ignore_eos": args.ignore_eos, "seed": args.seed,
                   "concurrency": args.concurrency,
                   "request_rate": [_rate(rate) for rate in args.request_rate],
                   "duration_s": args.duration, "disconnect_fraction": args.disconnect_fraction,
                   "disconnect_within_s": args.disconnect_within,
                   "hostile_rate": args.hostile_rate},
        "runs": runs,
    }
    print_table(report)
    finish(report, args.output, args.plot, earlier)
    return report


def _targets(args) -> list[Target]:
    base_urls = args.base_url or ["http://127.0.0.1:8000"]
    labels = args.label or [_short(url) for url in base_urls]
    if len(labels) != len(base_urls):
        raise ValueError(f"give one --label per --base-url ({len(base_urls)}), got {len(labels)}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must differ, got {labels}")
    return [Target(label, _normalize(url), args.model, args.api_key)
            for label, url in zip(labels, base_urls)]


def _normalize(base_url: str) -> str:
    """Accepts http://host:port, with or without a trailing / or /v1 (as OpenAI clients take it)."""
    url = base_url.rstrip("/")
    url = url.removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    return url


def _rate(request_rate: float) -> float | str:
    """JSON has no infinity: an unlimited rate is written "inf", as vLLM writes it."""
    return "inf" if request_rate == float("inf") else request_rate


def _short(base_url: str) -> str:
    return _normalize(base_url).split("://", 1)[1]


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", disable=not enabled, file=sys.stderr, leave=False)


def print_table(report: dict) -> None:
    width = max([14] + [len(run["label"]) for run in report["runs"]])  # labels in full
    header = (f"{'run':{width}s} {'kind':8s} {'conc':>5s} {'rate':>5s} {'done':>7s}"
              f" {'out tok/s':>10s} {'TPOT p50':>9s} {'TTFT p50':>9s} {'ITL p50':>8s}"
              f" {'accept':>7s} {'len':>5s}")
    print(header, file=sys.stderr)
    for run in report["runs"]:
        for r in run["results"]:
            spec = r["speculative"] or {}
            print(f"{run['label']:{width}s} {r['kind'][:8]:8s} {_cell(r['max_concurrency']):>5s} "
                  f"{_cell(r['request_rate']):>5s} {r['completed']:>3d}/{r['num_requests']:<3d} "
                  f"{r['output_throughput']:10.1f} {_cell(r['tpot_ms']['p50']):>9s} "
                  f"{_cell(r['ttft_ms']['p50']):>9s} {_cell(r['itl_ms']['p50']):>8s} "
                  f"{_cell(spec.get('acceptance_rate')):>7s} "
                  f"{_cell(spec.get('mean_acceptance_length')):>5s}", file=sys.stderr)
    print("times in ms; accept: acceptance rate, len: mean acceptance length (from /metrics)",
          file=sys.stderr)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return str(value)
