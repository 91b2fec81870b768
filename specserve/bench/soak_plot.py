"""The figure of a soak run (`specserve bench serve --duration`): over time, a row each for the
server's resident memory and event-loop lag, the requests' latency, and the failures, client
hang-ups and hostile refusals; a column per (target, workload, load level)."""

from __future__ import annotations

from pathlib import Path

from specserve.bench.plots import load_pyplot


def is_soak(report: dict) -> bool:
    return report.get("benchmark") == "serve" and bool(report.get("config", {}).get("duration_s"))


def plot_soak(report: dict, path: str | Path) -> None:
    pyplot = load_pyplot()
    columns = [(run["label"], result) for run in report["runs"] for result in run["results"]]
    figure, axes = pyplot.subplots(3, len(columns), figsize=(6 * len(columns), 9),
                                   squeeze=False, sharex="col")
    for column, (label, result) in enumerate(columns):
        memory, latency, errors = (axes[row][column] for row in range(3))
        states = result["server_state"]
        samples = [states["before"], *states["during"]]
        origin = samples[0]["t"]
        times = [state["t"] - origin for state in samples]
        memory.plot(times, [state["rss_bytes"] / 2**20 for state in samples], color="#4c72b0",
                    marker=".")
        memory.set_ylabel("server RSS (MiB)")
        memory.set_ylim(bottom=0)
        if "loop_lags_over_50ms" in samples[0]:
            lags = memory.twinx()
            lags.step(times, [state["loop_lags_over_50ms"] for state in samples], color="#c44e52",
                      where="post")
            lags.set_ylabel("event-loop lags > 50 ms (cumulative)", color="#c44e52")
            lags.set_ylim(bottom=0)
        memory.set_title(f"{label}: {result['kind']}, concurrency {result['max_concurrency']}, "
                         f"rate {result['request_rate']}")
        rows = result["timeline"]
        ends = [row["t_s"] for row in rows]
        for key, name in (("e2el_p50_ms", "p50"), ("e2el_p99_ms", "p99")):
            latency.plot(ends, [float("nan") if row[key] is None else row[key] / 1000
                                for row in rows], marker=".", label=f"latency {name}")
        latency.set_ylabel("request latency (s)")
        latency.set_ylim(bottom=0)
        latency.legend(fontsize="small")
        for key, colour in (("failed", "#c44e52"), ("client_disconnects", "#8c8c8c")):
            errors.step(ends, [row[key] for row in rows], where="pre", color=colour,
                        label=key.replace("_", " "))
        errors.set_ylabel("requests per window")
        errors.set_xlabel("seconds into the run")
        errors.set_ylim(bottom=0)
        hostile = result.get("hostile")
        title = "failures and planned hang-ups"
        if hostile:
            title += f"; hostile bodies: {hostile.get('sent')} sent, {hostile.get('statuses')}"
        errors.set_title(title, fontsize="small")
        errors.legend(fontsize="small")
        for axis in (memory, latency, errors):
            axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
