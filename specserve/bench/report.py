"""Where a benchmark's report goes: JSON on stdout and in `--output`, a figure in `--plot` (beside
the JSON by default), with earlier reports drawn alongside (`--compare`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specserve.bench import plots
from specserve.bench.soak_plot import is_soak, plot_soak


def load_report(path: str | Path) -> dict:
    """A report written by `specserve bench serve|offline --output`, tagged with its file name."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read report {path}: {error}") from None
    if not isinstance(report, dict) or report.get("benchmark") not in ("serve", "offline"):
        raise ValueError(f"{path} is not a report of specserve bench serve or offline")
    report["source"] = Path(path).stem
    return report


def draw(reports: list[dict], path: str | Path) -> None:
    """One figure: a soak run over time, every serve report's runs as lines, or one offline
    report's bars."""
    kinds = {report["benchmark"] for report in reports}
    if len(reports) == 1 and is_soak(reports[0]):
        plot_soak(reports[0], path)
    elif kinds == {"serve"}:
        plots.plot_serve(reports, path)
    elif kinds == {"offline"} and len(reports) == 1:
        plots.plot_offline(reports[0], path)
    else:
        raise ValueError("a figure shows serve reports, or exactly one offline report")
    print(f"figure written to {path}", file=sys.stderr)


def emit(report: dict, output: str | None, indent: int = 2) -> None:
    """Prints `report` as JSON, and saves it to `output` when given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if output:
        Path(output).write_text(text + "\n")


def finish(report: dict, output: str | None, plot: str | None,
           earlier: list[dict] | None = None) -> None:
    """Prints and saves `report`; draws it (with `earlier` reports, from load_report)."""
    emit(report, output)
    if plot is None and output:
        plot = str(Path(output).with_suffix(".png"))
    if plot:
        draw([report] + list(earlier or []), plot)


def taking_turns(names: list, n: int) -> list:
    """`names` rotated by `n`: the order in which systems take their turn on the n-th prompt.
    Whichever ran first on a prompt ran up to ~5% slower in runs of `none` against itself, so
    no system may always go first."""
    shift = n % len(names)
    return names[shift:] + names[:shift]
