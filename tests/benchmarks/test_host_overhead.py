"""benchmarks/host_overhead.py end to end: this tree beside a baseline checked out by git."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True,
                          capture_output=True, text=True).stdout


def test_host_overhead_report(tmp_path):
    output = tmp_path / "host.json"
    worktrees_before = _worktrees()
    subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--baseline", "HEAD",
                    "--batch-sizes", "1", "3", "--max-tokens", "4", "--repeats", "1",
                    "--output", str(output)], cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    report = json.loads(output.read_text())
    for tree in ("this", "baseline"):
        cells = report["results"][tree]
        assert set(cells) == {"padded/batch1", "padded/batch3", "flat/batch1", "flat/batch3"}
        padded = cells["padded/batch3"]
        assert padded["steps"] >= 4 and padded["ms_per_step"] > padded["host_ms_per_step"] > 0
        assert padded["phases_ms_per_step"]["prepare_padded"] > 0
        assert cells["flat/batch3"]["phases_ms_per_step"]["prepare_flat"] > 0
        assert 10 <= padded["ops_per_decoder_layer"] <= 24  # HEAD has this tree's layers
    assert set(report["ratios_baseline_over_this"]) == set(report["results"]["this"])
    machine = report["machine"]  # names its CPU: the model, and the flags telling kinds apart
    assert machine["cpu"] and set(machine["cpu_flags"]) <= {"avx2", "avx512f", "avx512_vnni",
                                                             "amx_int8"}
    assert _worktrees() == worktrees_before  # the baseline's checkout is gone
