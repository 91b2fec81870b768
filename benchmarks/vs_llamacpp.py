"""Helpers of benchmarks/vs_llamacpp.sh (specserve against llama.cpp on one GGUF file).

  ports N                  N free loopback TCP ports, space-separated
  wait URL PID [URL PID]   until every URL answers 200; fails at once when its PID has exited
  merge --output R P...    one serve report R (and its figure) from reports P of the same
                           servers at different load levels (one `bench serve` call per level,
                           so that each level gets as many prompts as it lets run at once)
  finish --serve R ...     adds what the serve report cannot know (versions, the servers'
                           command lines, how llama-cpp-python's server schedules requests, the
                           transformers run) to R, and prints tokens/s side by side
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.machine import cpu_model, float_variant, int8_variant, our_versions
from benchmarks.output_agreement import disagreements, same_weights_labels, without_texts

REFERENCE = "llama-server"  # the label the ratios divide by: llama.cpp's own C++ server

# What llama-cpp-python's server (llama_cpp/server/app.py, 0.3.x) does with concurrent requests.
LLAMACPP_SCHEDULING = (
    "llama-cpp-python's server holds one global lock per request (llama_outer_lock / "
    "llama_inner_lock in llama_cpp/server/app.py): it generates for one request at a time, the "
    "others wait in line (no parallel slots, no batching across requests; its high-level Llama "
    "object has a single sequence). By default (interrupt_requests=True) it even cuts a "
    "streaming response short as soon as another request waits; this benchmark starts it with "
    "--interrupt_requests false so every request is answered in full. At concurrency 16 its "
    "output tokens/s is therefore its single-stream speed and TTFT includes the wait in line.")
LLAMACPP_TOKEN_COUNT = (
    "llama-cpp-python's stream sends no usage (stream_options.include_usage is ignored), so its "
    "output tokens are counted as streamed text chunks (one per token, except tokens whose text "
    "is held back until a UTF-8 character or a possible stop string is complete).")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that nothing listens on now (the kernel picks them)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_ready(targets: list[tuple[str, int]], timeout: float = 900.0) -> None:
    """Returns once every URL answers 200; raises SystemExit when a server's process has exited
    or the time is up."""
    deadline = time.monotonic() + timeout
    for url, pid in targets:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if not _alive(pid):
                raise SystemExit(f"the server behind {url} (pid {pid}) exited before it was ready")
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} not ready after {timeout:.0f} s")
            time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited server the shell has not reaped yet still takes signal 0: a zombie.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def throughput_cells(serve_report: dict) -> dict[tuple[str, object], dict[str, dict]]:
    """{(kind, max_concurrency): {label: result}} in the report's order."""
    cells: dict[tuple[str, object], dict[str, dict]] = {}
    for run in serve_report["runs"]:
        for result in run["results"]:
            key = (result["kind"], result["max_concurrency"])
            cells.setdefault(key, {})[run["label"]] = result
    return cells


def summary_lines(serve_report: dict, offline_report: dict | None = None,
                  reference: str = REFERENCE) -> list[str]:
    """A plain-text table: per (workload, concurrency) each server's output tokens/s, its ratio
    to `reference` and the output tokens it generated (rates compare alike only when the token
    counts do), "!" where requests failed; then the transformers run's tokens/s."""
    labels = [run["label"] for run in serve_report["runs"]]
    width = max(22, *(len(label) + 2 for label in labels))
    lines = [f"output tokens/s, ratio to {reference}, output tokens generated "
             f"(! = some requests failed)",
             f"{'workload':9s}{'conc':>5s}" + "".join(f"{label:>{width}s}" for label in labels)]
    for (kind, concurrency), by_label in throughput_cells(serve_report).items():
        base = by_label.get(reference, {}).get("output_throughput")
        cells = []
        for label in labels:
            result = by_label.get(label)
            if result is None:
                cells.append(f"{'-':>{width}s}")
                continue
            rate = result["output_throughput"]
            ratio = f"{rate / base:.2f}x" if base and label != reference else ""
            failed = "!" if result["completed"] < result["num_requests"] else ""
            cell = f"{rate:.1f} {ratio:>6s} {result['total_output_tokens']:>5d}t{failed}"
            cells.append(f"{cell:>{width}s}")
        lines.append(f"{kind:9s}{str(concurrency):>5s}" + "".join(cells))
    if offline_report:
        lines.append("")
        lines.append(f"one process, batch 1, {offline_report.get('max_tokens')} new tokens (EOS "
                     f"ignored), best of {offline_report.get('repeats')}, tokens/s "
                     f"(ours/none: our engine on the dequantized float32 weights):")
        for system, by_kind in offline_report["results"].items():
            lines.append(f"  {system:12s}" + "".join(
                f"  {kind} {record['tokens_per_s']:.1f}" for kind, record in by_kind.items()))
    return lines


def merge_reports(parts: list[dict]) -> dict:
    """One serve report from reports of the same servers, in the same order, at different load
    levels: each server's results by workload, then by load level in the parts' order; the
    config lists every part's concurrency and number of prompts, aligned."""
    if not parts:
        raise ValueError("nothing to merge")
    labels = [run["label"] for run in parts[0]["runs"]]
    for part in parts[1:]:
        if [run["label"] for run in part["runs"]] != labels:
            raise ValueError(f"reports of different servers: {labels} vs "
                             f"{[run['label'] for run in part['runs']]}")
    kinds = list(dict.fromkeys(kind for part in parts for kind in part["config"]["workloads"]))
    runs = []
    for index, run in enumerate(parts[0]["runs"]):
        results = [result for part in parts for result in part["runs"][index]["results"]]
        results.sort(key=lambda result: kinds.index(result["kind"]))  # stable: levels in order
        runs.append({**run, "results": results})
    config = dict(parts[0]["config"])
    config["concurrency"] = [c for part in parts for c in part["config"]["concurrency"]]
    config["num_prompts"] = [part["config"]["num_prompts"]
                             for part in parts for _ in part["config"]["concurrency"]]
    return without_texts({**parts[0], "config": config, "runs": runs})


def annotate(serve_report: dict, extra: dict) -> dict:
    """The serve report with a "vs_llamacpp" section (kept apart from the fields `bench serve`
    and `bench plot` read, so the file stays a valid serve report)."""
    return {**serve_report, "vs_llamacpp": extra}


def server_warnings(logs: Path, labels: list[str], most: int = 20) -> dict[str, list[str]]:
    """Each server's logged warnings and errors (e.g. a GGUF kernel that could not be built and
    a slow fallback taken), at most `most` lines each."""
    found = {}
    for label in labels:
        try:
            lines = (logs / f"{label}.log").read_text(errors="replace").splitlines()
        except OSError:
            continue
        found[label] = [line for line in lines
                        if any(word in line for word in ("WARNING", "ERROR", "Traceback"))][:most]
    return found


def _llamacpp_info(python: str) -> dict:
    if not python:  # vs_llamacpp.sh --no-llama-cpp-python: not measured
        return {}
    code = ("import json, llama_cpp; print(json.dumps({'llama_cpp_python': llama_cpp.__version__,"
            " 'system_info': llama_cpp.llama_print_system_info().decode().strip()}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _llama_server_info(binary: str | None) -> dict:
    if not binary:
        return {}
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        return {"binary": binary, "version": (done.stdout + done.stderr).strip()}
    except (OSError, subprocess.SubprocessError) as error:
        return {"binary": binary, "error": f"{type(error).__name__}: {error}"}


def finish(args: argparse.Namespace) -> None:
    serve_path = Path(args.serve)
    report = json.loads(serve_path.read_text())
    offline = json.loads(Path(args.offline).read_text()) if args.offline else None
    servers = {}
    for item in args.server or []:
        label, _, command = item.partition("=")
        servers[label] = command
    extra = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_file": args.model_file,
        "threads": args.threads,
        "servers": servers,
        "versions": {"llama.cpp": _llamacpp_info(args.llamacpp_python),
                     "llama-server": _llama_server_info(args.llama_server),
                     "specserve": our_versions()},
        "specserve_int8_kernel_variant": int8_variant(),
        "specserve_float_kernel_variant": float_variant(),
        "llamacpp_parallel_requests": False,
        "llamacpp_scheduling": LLAMACPP_SCHEDULING,
        "llamacpp_token_count": LLAMACPP_TOKEN_COUNT,
        "specserve_outputs": {"compared": same_weights_labels(list(servers)),
                              "differ": disagreements(throughput_cells(report),
                                                        same_weights_labels(list(servers))),
                              "texts_in": args.logs},
        "server_warnings": server_warnings(Path(args.logs), list(servers)) if args.logs else None,
        "transformers_report": str(args.offline) if args.offline else None,
        "transformers": ({system: {kind: record["tokens_per_s"] for kind, record in by_kind.items()}
                          for system, by_kind in offline["results"].items()} if offline else None),
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(),
                    "load_average_1min_at_start": args.load_at_start,
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    serve_path.write_text(json.dumps(annotate(report, extra), indent=2) + "\n")
    print("\n".join(summary_lines(report, offline)))
    print(f"\nllama.cpp: {extra['versions']['llama.cpp']}, {extra['versions']['llama-server']}")
    outputs = extra["specserve_outputs"]
    print(f"greedy answers of {' and '.join(outputs['compared'])}: " + (
        "equal in every cell" if not outputs["differ"] else
        f"DIFFER in {len(outputs['differ'])} cells (texts: {args.logs}/serve_c*.json)"))
    print(f"specserve integer kernels: {extra['specserve_int8_kernel_variant']}, float kernels: "
          f"{extra['specserve_float_kernel_variant']}")
    print(f"reports: {serve_path}" + (f", {args.offline}" if args.offline else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_llamacpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ports = commands.add_parser("ports")
    ports.add_argument("count", type=int)
    wait = commands.add_parser("wait")
    wait.add_argument("pairs", nargs="+", help="URL PID URL PID ...")
    wait.add_argument("--timeout", type=float, default=900.0)
    merge = commands.add_parser("merge")
    merge.add_argument("parts", nargs="+", help="serve reports, one per load level")
    merge.add_argument("--output", required=True, help="JSON to write (and .png beside it)")
    end = commands.add_parser("finish")
    end.add_argument("--serve", required=True, help="the bench serve report (rewritten)")
    end.add_argument("--offline", default=None, help="the bench offline report")
    end.add_argument("--llamacpp-python", required=True, help="python of the llama.cpp venv ('' when llama-cpp-python was not run)")
    end.add_argument("--llama-server", default=None, help="the llama-server binary measured")
    end.add_argument("--server", action="append", help="LABEL=command line, per server")
    end.add_argument("--model-file", default=None)
    end.add_argument("--threads", type=int, default=None)
    end.add_argument("--load-at-start", type=float, default=None)
    end.add_argument("--logs", default=None, help="folder of the servers' LABEL.log files")
    args = parser.parse_args(argv)
    if args.command == "ports":
        print(" ".join(map(str, free_ports(args.count))))
    elif args.command == "wait":
        if len(args.pairs) % 2:
            parser.error("wait takes URL PID pairs")
        pairs = [(args.pairs[i], int(args.pairs[i + 1])) for i in range(0, len(args.pairs), 2)]
        wait_ready(pairs, args.timeout)
    elif args.command == "merge":
        from specserve.bench.report import draw

        report = merge_reports([json.loads(Path(path).read_text()) for path in args.parts])
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        draw([report], Path(args.output).with_suffix(".png"))
    else:
        finish(args)


if __name__ == "__main__":
    sys.exit(main())
