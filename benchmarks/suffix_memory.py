"""The suffix cache's memory target: 10,000 requests through the server grow its resident memory
by at most 100 MB at the default bounds (--suffix-cache-max-requests, --suffix-cache-max-bytes).

    PYTHONPATH=. python -m benchmarks.suffix_memory --output benchmarks/results/suffix_memory.json

Starts one `python -m server serve --speculative-method suffix` (plus `--server-args`), sends
`--requests` chat requests with distinct prompts made from a seeded RNG (records and sentences of
varied lengths, sampled at T > 0 with a seed each, so the outputs the cache holds differ),
`--concurrency` at a time. Before the first request, after the warm-up (the first 100) and every
500 requests it records the resident memory of the server and all its descendants (the chat
template worker: /proc/<pid>/status VmRSS) and the suffix cache's series from /metrics. The
verdict compares the growth after the warm-up with the limit (the warm-up holds one-time
allocations: allocator pools, compiled kernels, the first template renders); the growth from the
start is reported beside it. MB here is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.agentic_servers import Servers, free_ports, specserve_command
from benchmarks.agentic_workloads import CITIES, FIRST_NAMES, PRODUCTS
from benchmarks.processes import tree_rss_bytes
from specserve.bench.report import emit

LIMIT_MB = 100
WARMUP_REQUESTS = 100
SAMPLE_EVERY = 500
SETTLE_S = 1.0
WORDS = ("the agent checked a booking before sending the invoice while every order waited on "
         "stock from one warehouse near the river so nobody could ship fragile lamps until "
         "Monday and the manager asked for a summary of refunds delays prices and notes").split()
TASKS = ("Convert this record to YAML. Output only YAML.", "Summarise this in one sentence.",
         "Rewrite this as a bulleted list.", "Translate the field names to French.",
         "Write one SQL INSERT for the table orders from this.")


def distinct_prompt(rng: random.Random, index: int) -> str:
    """A prompt unlike the others: a task, 1-6 random records and 0-3 random sentences; the
    request number keeps two draws from ever being equal."""
    records = [{"request": index, "id": rng.randint(1, 10**6), "name": rng.choice(FIRST_NAMES),
                "city": rng.choice(CITIES), "product": rng.choice(PRODUCTS),
                "quantity": rng.randint(1, 500), "price": round(rng.uniform(1, 5000), 2)}
               for _ in range(rng.randint(1, 6))]
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(5, 40))).capitalize() + "."
                 for _ in range(rng.randint(0, 3))]
    return "\n".join([rng.choice(TASKS), *map(json.dumps, records), *sentences])


def checkpoints(num_requests: int, warmup: int = WARMUP_REQUESTS,
                every: int = SAMPLE_EVERY) -> list[int]:
    """After how many requests memory is sampled: the warm-up, every `every`, and the last."""
    points = {count for count in range(every, num_requests + 1, every)}
    points |= {min(warmup, num_requests), num_requests}
    return sorted(point for point in points if point > 0)


def suffix_cache_series(exposition: str) -> dict[str, float]:
    """Every sample whose name holds `suffix_cache` (requests, nodes, bytes, evictions...)."""
    return {sample.name: sample.value for family in text_string_to_metric_families(exposition)
            for sample in family.samples if "suffix_cache" in sample.name}


def verdict(samples: list[dict], limit_mb: float = LIMIT_MB,
            warmup: int = WARMUP_REQUESTS) -> dict:
    """Growth from the warm-up sample (the first after `warmup` requests) and from the start to
    the last sample, in MB, and whether each stayed within `limit_mb`. A run no longer than the
    warm-up has no growth after it: None, and no verdict."""
    start, end = samples[0]["rss_bytes"], samples[-1]["rss_bytes"]
    from_start_mb = round((end - start) / 1e6, 1)
    after_warmup_mb = None
    if samples[-1]["requests"] > warmup:
        warm = next(s for s in samples if s["requests"] >= warmup)["rss_bytes"]
        after_warmup_mb = round((end - warm) / 1e6, 1)
    return {"growth_after_warmup_mb": after_warmup_mb, "growth_from_start_mb": from_start_mb,
            "limit_mb": limit_mb,
            "passed": None if after_warmup_mb is None else after_warmup_mb <= limit_mb,
            "passed_from_start": from_start_mb <= limit_mb}


def send_chat(url: str, prompt: str, max_tokens: int, temperature: float, seed: int) -> bool:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).is_success
    except httpx.HTTPError:
        return False


def sample(url: str, server_pid: int, requests: int, failed: int, started: float) -> dict:
    """Taken once the server is idle: its engine hands freed memory back when a burst ends, a
    moment after the last answer."""
    time.sleep(SETTLE_S)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return {"requests": requests, "failed": failed, "t_s": round(time.monotonic() - started, 1),
            **tree_rss_bytes(server_pid), "suffix_cache": suffix_cache_series(metrics)}


def run(url: str, server_pid: int, args: argparse.Namespace,
        progress=lambda samples: None) -> list[dict]:
    """Sends the requests in runs that end at the checkpoints, sampling after each and handing
    the samples so far to `progress`."""
    rng = random.Random(args.seed)
    started = time.monotonic()
    samples = [sample(url, server_pid, 0, 0, started)]
    sent = failed = 0
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for point in checkpoints(args.requests):
            prompts = [distinct_prompt(rng, index) for index in range(sent, point)]
            outcomes = pool.map(lambda job: send_chat(url, job[1], args.max_tokens,
                                                      args.temperature, args.seed + job[0]),
                                enumerate(prompts, start=sent))
            failed += sum(not ok for ok in outcomes)
            sent = point
            samples.append(sample(url, server_pid, sent, failed, started))
            print(f"{sent} requests ({failed} failed): RSS "
                  f"{samples[-1]['rss_bytes'] / 1e6:.1f} MB", file=sys.stderr)
            progress(samples)
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `specserve serve` flags")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    servers = Servers(Path(args.log_dir))
    port = free_ports(1)[0]
    servers.launch("suffix_memory", specserve_command("suffix", port, args.server_args.split()),
                   port, ours=True)
    servers.wait_healthy()
    url, pid = servers.targets[0].url, servers.processes["suffix_memory"].pid

    def report(samples: list[dict]) -> dict:
        return {"benchmark": "suffix_memory", "requests": args.requests,
                "requests_done": samples[-1]["requests"], "max_tokens": args.max_tokens,
                "concurrency": args.concurrency, "temperature": args.temperature,
                "seed": args.seed, "server_args": args.server_args,
                "server": servers.commands["suffix_memory"], **verdict(samples),
                "samples": samples}

    def checkpoint(samples: list[dict]) -> None:
        # A run of 10,000 requests takes over an hour on a small CPU: what it has measured so
        # far is on disk at every sample, marked partial, should it be stopped.
        if args.output and samples[-1]["requests"] < args.requests:
            Path(args.output).write_text(json.dumps({**report(samples), "partial": True},
                                                    indent=1) + "\n")

    samples = run(url, pid, args, checkpoint)
    servers.stop()
    emit(report(samples), args.output)


if __name__ == "__main__":
    main()
