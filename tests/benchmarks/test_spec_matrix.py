"""benchmarks/spec_matrix.py end to end on a tiny model: the report's shape and its figure."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import spec_matrix


def test_spec_matrix_report(tiny_chat_model_folder, tmp_path, capsys):
    output, figure = tmp_path / "matrix.json", tmp_path / "matrix.png"
    report = spec_matrix.main([
        "--model", str(tiny_chat_model_folder), "--workload", "code,copy", "--num-prompts", "1",
        "--max-tokens", "4", "--temperatures", "0,0.7", "--batch1-methods", "none,ngram",
        "--matrix-methods", "none,ngram", "--concurrency", "1,2", "--matrix-max-tokens", "4",
        "--output", str(output), "--plot", str(figure)])
    assert json.loads(output.read_text()) == report
    assert figure.stat().st_size > 0
    greedy = report["batch1"]["0.0"]["code"]
    assert greedy["none"]["ratio_vs_none"] == 1.0
    assert greedy["ngram"]["same_tokens_as_none"] is True
    assert "same_tokens_as_none" not in report["batch1"]["0.7"]["code"]["ngram"]
    cell = report["matrix"]["copy"]["2"]["ngram"]
    assert cell["same_tokens_as_none"] is True and cell["ratio_vs_none"] > 0
    # every cell warmed untimed first, its seconds apart from the timed ones
    assert cell["warmup_seconds"] > 0 and cell["seconds"] > 0
    warmups = report["warmup_seconds"]
    assert warmups["engines"] > 0
    assert warmups["matrix_cells"] == pytest.approx(sum(
        record["warmup_seconds"] for by_level in report["matrix"].values()
        for row in by_level.values() for record in row.values()), abs=0.01)
    assert "[matrix copy c=2]" in capsys.readouterr().err


def test_a_method_may_name_its_draft_head(tmp_path):
    """`eagle-head@DIR` is eagle-head with the head in DIR; plain names keep the shipped one."""
    assert spec_matrix.method_options("eagle-head", None) == {
        "speculative_method": "eagle", "eagle_ngram_min": 0}
    assert spec_matrix.method_options(f"eagle-head@{tmp_path}", None) == {
        "speculative_method": "eagle", "eagle_ngram_min": 0, "draft_head": str(tmp_path)}
    assert spec_matrix.method_options(f"eagle@{tmp_path}", None) == {
        "speculative_method": "eagle", "draft_head": str(tmp_path)}


def test_warm_up_prompts_keep_their_length_and_change_their_text():
    prompt = [5, 0, 255]
    assert spec_matrix.shifted(prompt, 256) == [6, 1, 0]


def test_a_gpu_matrix_refuses_cells_shorter_than_the_steady_state(monkeypatch):
    assert spec_matrix.MIN_MATRIX_TOKENS >= 256
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        spec_matrix.main(["--matrix-max-tokens", "32"])
