"""The figure of benchmarks/spec_matrix.py's report: batch-1 ratios per temperature, then every
matrix cell's ratio to `none`."""

from __future__ import annotations


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(report["batch1"])
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(6 * (len(temps) + 1), 4.5))
    for ax, temp in zip(axes, temps):
        results = report["batch1"][temp]
        kinds = list(results)
        methods = [m for m in results[kinds[0]] if m != "none"]
        width = 0.8 / len(methods)
        for n, method in enumerate(methods):
            ax.bar([k + n * width for k in range(len(kinds))],
                   [results[kind][method]["ratio_vs_none"] for kind in kinds], width, label=method)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
        ax.set_title(f"batch 1, temperature {temp}: tokens/s vs none")
        ax.legend(fontsize=8)
    ax = axes[-1]
    labels, values = [], []
    for kind, by_level in report["matrix"].items():
        for level, row in by_level.items():
            for method, record in row.items():
                labels.append(f"{kind} c{level} {method}")
                values.append(record["ratio_vs_none"])
    ax.barh(range(len(values)), values, color=["C3" if v < 0.95 else "C2" for v in values])
    ax.axvline(0.95, color="red", lw=0.8, ls="--")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_yticks(range(len(values)), labels, fontsize=6)
    ax.set_title("matrix, greedy: tokens/s vs none (red line: 0.95)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
