"""The served step against the offline one: the same prompt token ids, greedy, batch 1, through
`LLM.generate` on this process's main thread and through `specserve serve` over HTTP, interleaved
prompt by prompt so that the host's minute-to-minute noise falls on every path alike. With
`--baseline REF` a server from an older tree (a temporary git worktree) runs beside them.

    python -m benchmarks.server_vs_offline [--method none] [--prompts 3] [--baseline 0afc884]

Prints one JSON report (tok/s per workload kind and path, server/offline ratios) and writes it
with --output. Chat prompts go in with the chat template already applied, to /v1/completions, so
every path computes the same tokens; the report says whether the greedy outputs were equal.
"""

from __future__ import annotations

import engine  # noqa: F401  # isort: skip  (first: it sets OpenMP's wait policy before torch loads)

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from datetime import date
from pathlib import Path

import httpx

from benchmarks.machine import baseline_tree, cpu_model
from benchmarks.vs_llamacpp import free_ports, wait_ready
from engine import LLM, SamplingParams
from specserve.bench.report import emit
from specserve.bench.workloads import KINDS, encode, load_workloads

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def served(tree: Path, method: str, log):
    """`specserve serve` from `tree` (its own packages first on the path) on a free port."""
    (port,) = free_ports(1)
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
         "--speculative-method", method], cwd=tree, stdout=log, stderr=log)
    try:
        wait_ready([(f"http://127.0.0.1:{port}/ready", process.pid)])
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def offline_run(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    started = time.perf_counter()
    (output,) = llm.generate([prompt_ids], params)
    return list(output.token_ids), time.perf_counter() - started


def http_run(client: httpx.Client, url: str, prompt_ids: list[int],
             max_tokens: int) -> tuple[int, str, float]:
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    data = response.json()
    return data["usage"]["completion_tokens"], data["choices"][0]["text"], elapsed


def measure(args, urls: dict[str, str]) -> dict:
    llm = LLM(speculative_method=args.method)
    tokenizer = llm.tokenizer
    totals = {kind: {path: [0, 0.0] for path in ["offline", *urls]} for kind in KINDS}
    equal = True
    with httpx.Client(timeout=600) as client:
        for url in urls.values():  # warm-up: the first request of a process pays one-time costs
            http_run(client, url, [1, 2, 3], 4)
        offline_run(llm, [1, 2, 3], 4)
        for kind in KINDS:
            for workload in load_workloads(kind, args.prompts):
                prompt_ids = encode(tokenizer, workload)
                token_ids, seconds = offline_run(llm, prompt_ids, args.max_tokens)
                totals[kind]["offline"][0] += len(token_ids)
                totals[kind]["offline"][1] += seconds
                offline_text = tokenizer.decode(token_ids, skip_special_tokens=True)
                for path, url in urls.items():
                    count, text, seconds = http_run(client, url, prompt_ids, args.max_tokens)
                    totals[kind][path][0] += count
                    totals[kind][path][1] += seconds
                    equal &= count == len(token_ids) and text == offline_text
    results = {}
    for kind, paths in totals.items():
        rates = {path: round(tokens / seconds, 1) for path, (tokens, seconds) in paths.items()}
        results[kind] = {"tok_s": rates, "over_offline": {
            path: round(rate / rates["offline"], 3) for path, rate in rates.items()
            if path != "offline"}}
    return {"results": results, "greedy_outputs_equal": equal}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="none", help="--speculative-method of every path")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per workload kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--baseline", help="git ref whose server runs beside this tree's")
    parser.add_argument("--output", help="also write the JSON report here")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        log = stack.enter_context(tempfile.TemporaryFile())
        trees = {"server": ROOT}
        if args.baseline:
            trees["baseline_server"] = stack.enter_context(baseline_tree(args.baseline))
        urls = {path: stack.enter_context(served(tree, args.method, log))
                for path, tree in trees.items()}
        report = measure(args, urls)
    report = {"benchmark": "server_vs_offline", "date": date.today().isoformat(),
              "cpu": cpu_model(), "machine": platform.machine(), "threads": "torch default",
              "method": args.method, "max_tokens": args.max_tokens,
              "prompts_per_kind": args.prompts, "baseline": args.baseline, **report}
    emit(report, args.output, indent=2)


if __name__ == "__main__":
    main()
