"""benchmarks/experiments/invariant_tiles.py on the CPU, under Triton's interpreter: the sweep's
report, each candidate checked for row invariance, cuBLAS's time beside."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine.interpreted import ROOT

pytest.importorskip("triton")


def test_the_sweep_reports_invariant_tiles_beside_cublas(tmp_path):
    output = tmp_path / "tiles.json"
    subprocess.run([sys.executable, "-m", "benchmarks.experiments.invariant_tiles", "--models",
                    "tiny", "--candidates", "2", "--iters", "1", "--output", str(output)],
                   cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)),
                   check=True, capture_output=True, timeout=600)
    shape = json.loads(output.read_text())["shapes"]["tiny/tiny"]
    assert set(shape["cublas_ms"]) == {"1", "8", "64"}
    assert len(shape["candidates"]) == 2  # the default tiles are the first candidate
    assert all(c["row_invariant"] for c in shape["candidates"])
    assert shape["best"]["tiles"] in [c["tiles"] for c in shape["candidates"]]
