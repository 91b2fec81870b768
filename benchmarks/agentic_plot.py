"""The figure of a benchmarks/agentic.py report: per workload, a group of bars of completion
tokens/s per method (suffix/none written over the group), and below it the acceptance rates.

    PYTHONPATH=. python -m benchmarks.agentic_plot REPORT.json FIGURE.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from specserve.bench.plots import load_pyplot


def target_labels(report: dict) -> list[str]:
    """Every method or server measured, in the order the report first names them."""
    labels: dict[str, None] = {}
    for result in report["workloads"].values():
        for key, value in result.items():
            if isinstance(value, dict) and "tokens_per_s" in value:
                labels[key] = None
    return list(labels)


def _value(result: dict, label: str, field: str) -> float:
    """The field of one target in one workload, NaN where it did not run or has no value (a bar
    matplotlib leaves out)."""
    value = result.get(label, {}).get(field)
    return math.nan if value is None else float(value)


def _rates(result: dict, labels: list[str]) -> list[float]:
    """The tokens/s of the targets that ran this workload."""
    rates = [_value(result, label, "tokens_per_s") for label in labels]
    return [rate for rate in rates if not math.isnan(rate)]


def _title(report: dict) -> str:
    concurrency = report.get("concurrency", 1)
    load = "batch 1" if concurrency == 1 else f"concurrency {concurrency}"
    return (f"{report.get('cpu') or 'unknown CPU'}: {load}, max_tokens "
            f"{report.get('max_tokens')}, through the server")


def plot_agentic(report: dict, path: str | Path) -> None:
    pyplot = load_pyplot()
    workloads = list(report["workloads"])
    labels = target_labels(report)
    figure, (speed, acceptance) = pyplot.subplots(
        2, 1, figsize=(max(7.0, 2.5 + 1.9 * len(workloads)), 8), sharex=True,
        gridspec_kw={"height_ratios": [3, 2]})
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        positions = [k + (index - (len(labels) - 1) / 2) * width for k in range(len(workloads))]
        results = [report["workloads"][name] for name in workloads]
        speed.bar(positions, [_value(r, label, "tokens_per_s") for r in results], width,
                  label=label, color=f"C{index}")
        rates = [_value(r, label, "acceptance_rate") for r in results]
        bars = acceptance.bar(positions, rates, width, color=f"C{index}")
        # written out, so that a rate of 0 reads apart from a method that drafts nothing
        acceptance.bar_label(bars, ["" if math.isnan(rate) else f"{rate:.2f}" for rate in rates],
                             fontsize=7)
    for column, name in enumerate(workloads):
        result = report["workloads"][name]
        top = max(_rates(result, labels), default=0.0)
        ratio = result.get("suffix_over_none")
        if ratio is not None:
            speed.text(column, top * 1.03, f"suffix/none {ratio:.2f}x", ha="center",
                       va="bottom", fontsize=9, fontweight="bold")
    speed.set_ylabel("completion tokens/s")
    tallest = max((rate for r in report["workloads"].values() for rate in _rates(r, labels)),
                  default=0.0)
    speed.set_ylim(0, 1.25 * tallest or 1.0)  # room for the ratios over the bars
    speed.set_title(_title(report), fontsize=10)
    speed.legend(fontsize="small", ncols=2)
    acceptance.set_ylabel("acceptance rate (accepted / drafted)")
    acceptance.set_ylim(0, 1.05)
    acceptance.set_xticks(range(len(workloads)), workloads)
    for axis in (speed, acceptance):
        axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw a benchmarks/agentic.py report.")
    parser.add_argument("report", help="the JSON written by benchmarks.agentic --output")
    parser.add_argument("figure", help="the PNG to write")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    if report.get("benchmark") != "agentic":
        raise SystemExit(f"{args.report} is not a report of benchmarks.agentic")
    plot_agentic(report, args.figure)
    print(f"figure written to {args.figure}")


if __name__ == "__main__":
    main()
