"""Issue 71's fused kernels side by side, from the JSON files device_check.sh `fused71` writes:
the batch-1 step (kernels, ms, tok/s, device-busy ms, graph replay ms) with the fused kernels on,
off, on with programmatic dependent launch and on with --batch-invariant, and the 8B shape's step against the bandwidth limit
with them on and off.

    python -m benchmarks.fused_summary OUT_DIR GPU_NAME [--output PATH]

Files it reads (each optional: a missing one is reported as missing): profile_step_fused_{on,off,
pdl,invariant}_GPU.json, real_size_fused_{on,off}_GPU.json, fused_tiles_GPU.json. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STEP_MODES = ("on", "off", "pdl", "invariant")  # invariant: on, with --batch-invariant
STEP_FIELDS = ("fused_layers", "kernels_per_step", "ms_per_step", "tokens_per_s", "device_busy_ms_per_step",
               "graph_replay_ms")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_row(report: dict | None) -> dict:
    if report is None:
        return {"missing": True}
    none = report.get("results", {}).get("none", {})
    return {field: none.get(field) for field in STEP_FIELDS} | (
        {"error": none["error"]} if "error" in none else {})


def real_size_row(report: dict | None) -> dict:
    if report is None:
        return {"missing": True}
    return {"fused_layers": report.get("config", {}).get("fused_layers"),
            "bandwidth_limit_ms": report.get("bandwidth_limit_ms"),
            "decode_rows": report.get("decode_rows"),
            "verify_over_one_row": report.get("verify_over_one_row")}


def ratio(a, b):
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b \
        else None


def summary(out_dir: Path, gpu: str) -> dict:
    steps = {mode: step_row(_read(out_dir / f"profile_step_fused_{mode}_{gpu}.json"))
             for mode in STEP_MODES}
    sizes = {mode: real_size_row(_read(out_dir / f"real_size_fused_{mode}_{gpu}.json"))
             for mode in ("on", "off")}
    first = next((r for r in (_read(out_dir / f"profile_step_fused_{m}_{gpu}.json")
                              for m in STEP_MODES) if r), {})
    facts = {k: v for k, v in first.items() if k not in ("results", "config", "benchmark")}
    facts["versions"] = {**facts.get("versions", {}), "triton": _triton_version()}
    one_row = {mode: (row.get("decode_rows") or {}).get("1", {}) for mode, row in sizes.items()}
    tiles = _read(out_dir / f"fused_tiles_{gpu}.json")
    return {
        "benchmark": "fused71", **facts,
        "batch1_step": steps,
        "fused_over_off": {field: ratio(steps["on"].get(field), steps["off"].get(field))
                           for field in ("kernels_per_step", "ms_per_step", "tokens_per_s")},
        "pdl_over_on_ms": ratio(steps["pdl"].get("ms_per_step"), steps["on"].get("ms_per_step")),
        "invariant_over_on_ms": ratio(steps["invariant"].get("ms_per_step"),
                                      steps["on"].get("ms_per_step")),
        "targets": {"kernels_per_step_le_120": _le(steps["on"].get("kernels_per_step"), 120),
                    "ms_per_step_le_0.5": _le(steps["on"].get("ms_per_step"), 0.5),
                    "tokens_per_s_ge_2000": _le(2000, steps["on"].get("tokens_per_s")),
                    "8b_one_row_le_1.15x_limit": _le(one_row["on"].get("over_bandwidth_limit"),
                                                     1.15),
                    "batch_invariant_le_1.1x": _le(ratio(steps["invariant"].get("ms_per_step"),
                                                         steps["on"].get("ms_per_step")), 1.1)},
        "real_size_8b": sizes,
        "tuned_entries": None if tiles is None else tiles.get("tuned_entries"),
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _le(a, b):
    return a <= b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("gpu")
    parser.add_argument("--output")
    args = parser.parse_args()
    text = json.dumps(summary(Path(args.out_dir), args.gpu), indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
