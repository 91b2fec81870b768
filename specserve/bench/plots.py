"""The PNG figures of the benchmarks (matplotlib, drawn off-screen).

  serve    output tokens/s and median TPOT against load, a column per workload kind, a line per
           run (a target of one report, or of a report given to --compare)
  offline  tokens/s of every system relative to our engine without speculation, a group of bars
           per workload kind
"""

from __future__ import annotations

from pathlib import Path


def load_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("drawing figures needs matplotlib: pip install 'specserve[bench]'") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as pyplot

    return pyplot


def load_axis(results: list[dict]) -> str:
    """The result field the x axis shows: the concurrency cap unless only the rate varies."""
    caps = {result["max_concurrency"] for result in results}
    rates = {result["request_rate"] for result in results}
    only_rates_vary = (None in caps or len(caps) == 1) and len(rates) > 1
    return "request_rate" if only_rates_vary else "max_concurrency"


def serve_lines(reports: list[dict]) -> dict[str, list[dict]]:
    """Every run of every report by a unique label (a report's file name is prefixed when two
    runs share a label)."""
    lines: dict[str, list[dict]] = {}
    for report in reports:
        for run in report["runs"]:
            label = run["label"]
            if label in lines:
                label = f"{report.get('source', 'run')}:{label}"
            lines[label] = run["results"]
    return lines


def plot_serve(reports: list[dict], path: str | Path) -> None:
    pyplot = load_pyplot()
    lines = serve_lines(reports)
    kinds = list(dict.fromkeys(r["kind"] for results in lines.values() for r in results))
    axis = load_axis([r for results in lines.values() for r in results])
    figure, axes = pyplot.subplots(2, len(kinds), figsize=(4.5 * len(kinds), 7), squeeze=False)
    ticks = sorted({float(r[axis]) for results in lines.values() for r in results
                    if r[axis] not in (None, "inf")})
    panels = (("output_throughput", "output tokens/s"), ("tpot_ms", "TPOT p50 (ms)"))
    for column, kind in enumerate(kinds):
        for row, (field, ylabel) in enumerate(panels):
            ax = axes[row][column]
            for label, results in lines.items():
                points = sorted((float(r[axis]), _y(r[field])) for r in results
                                if r["kind"] == kind and r[axis] not in (None, "inf"))
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("max concurrency" if axis == "max_concurrency" else "request rate (/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(kind)
    axes[0][0].legend(fontsize="small")
    config = reports[0].get("config", {})
    figure.suptitle(f"{reports[0]['runs'][0]['model']}, max_tokens {config.get('max_tokens')}, "
                    f"temperature {config.get('temperature')}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def plot_offline(report: dict, path: str | Path) -> None:
    pyplot = load_pyplot()
    systems = list(report["results"])
    kinds = list(dict.fromkeys(kind for by_kind in report["results"].values() for kind in by_kind))
    figure, ax = pyplot.subplots(figsize=(2 + 1.1 * len(kinds) * len(systems) / 2, 4.5))
    width = 0.8 / len(systems)
    for index, system in enumerate(systems):
        speedups = [report["results"][system].get(kind, {}).get("speedup_vs_ours_none") or 0
                    for kind in kinds]
        positions = [k + (index - (len(systems) - 1) / 2) * width for k in range(len(kinds))]
        ax.bar(positions, speedups, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("tokens/s relative to ours/none")
    ax.set_title(f"{report.get('model', '')}, batch 1, greedy")
    ax.legend(fontsize="small", ncols=2)
    ax.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def _y(value) -> float:
    """A plain number, or the median of a latency distribution (None when there was none)."""
    if isinstance(value, dict):
        value = value.get("p50")
    return float("nan") if value is None else float(value)


def draw_step_profiles(reports: dict[str, dict], path: str | Path) -> None:
    """profile_step reports side by side: per label and method, a bar of the step's ms split into
    device-busy time and the host phases the device did not hide (a stacked bar each)."""
    pyplot = load_pyplot()
    bars = [(f"{label}\n{method}", result) for label, report in reports.items()
            for method, result in report["results"].items() if "ms_per_step" in result]
    figure, axis = pyplot.subplots(figsize=(1.6 + 1.3 * len(bars), 4.2))
    for x, (_name, result) in enumerate(bars):
        busy = result.get("device_busy_ms_per_step") or 0.0
        exposed = max(result["ms_per_step"] - busy, 0.0)
        axis.bar(x, busy, color="#4c72b0", label="device busy" if x == 0 else None)
        axis.bar(x, exposed, bottom=busy, color="#dd8452",
                 label="host time not hidden" if x == 0 else None)
        axis.text(x, busy + exposed, f"{result['ms_per_step']:.2f} ms\n"
                  f"{result.get('kernels_per_step') or 0:.0f} kernels", ha="center",
                  va="bottom", fontsize=8)
    axis.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    axis.set_ylabel("ms per batch-1 decode step")
    axis.legend(fontsize=8)
    axis.set_ylim(0, 1.25 * max(r["ms_per_step"] for _, r in bars))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
