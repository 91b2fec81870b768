"""benchmarks/experiments/sliding_window_kv.py runs end to end on a short request: its report shows the
released run holding the window's blocks and the kept run (the control) every block."""

from __future__ import annotations

from benchmarks.experiments import sliding_window_kv


def test_the_report_shows_blocks_given_back_behind_the_window(tmp_path):
    report = sliding_window_kv.main(["--max-tokens", "60", "--window", "16", "--block-size", "4",
                                     "--output", str(tmp_path / "kv.json")])
    assert report["released"]["peak_blocks"] <= report["blocks_the_window_reaches"] + 1
    assert report["kept"]["peak_blocks"] >= report["context_tokens"] // 4
    assert (tmp_path / "kv.json").is_file()
