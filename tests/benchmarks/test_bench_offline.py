"""`specserve bench offline`, smoke-sized: every system measured, greedy tokens equal, a figure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_offline_comparison_writes_report_and_bar_chart(default_model_folder, tmp_path):
    output = tmp_path / "offline.json"
    result = subprocess.run(
        [sys.executable, "-m", "specserve", "bench", "offline", "--workload", "copy",
         "--num-prompts", "1", "--max-tokens", "8", "--methods", "none,ngram",
         "--hf-modes", "plain", "--concurrency", "2", "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert report["benchmark"] == "offline"
    results = report["results"]
    assert set(results) == {"ours/none", "ours/ngram", "hf/plain"}
    assert all(record["copy"]["num_tokens"] == 8 and record["copy"]["tokens_per_s"] > 0
               for record in results.values())
    assert results["ours/none"]["copy"]["speedup_vs_ours_none"] == 1.0
    assert results["ours/ngram"]["copy"]["same_tokens_as_none"] is True
    assert report["concurrency"]["same_tokens_ngram_as_none"] is True
    assert (tmp_path / "offline.png").read_bytes().startswith(b"\x89PNG")
