"""`specserve bench serve` against the real server: the report's numbers, counts and figure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.output_agreement import disagreements
from benchmarks.vs_llamacpp import throughput_cells
from specserve.bench.serving_metrics import output_digest

SUMMARY_KEYS = {"num_requests", "completed", "failed", "errors", "duration_s",
                "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                "e2el_ms"}
DISTRIBUTION_KEYS = {"mean", "std", "p50", "p90", "p99"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve", "bench", *args], capture_output=True,
                          text=True, timeout=600, check=check)


@pytest.mark.slow
def test_sweep_of_two_targets_reports_every_metric(server, tmp_path):
    output, figure = tmp_path / "run.json", tmp_path / "run.png"
    # The same server twice, once as OpenAI clients spell it (/v1): two runs side by side.
    result = bench("serve", "--base-url", server.base_url, "--base-url", server.base_url + "/v1/",
                   "--label", "first", "--label", "second", "--workload", "code,chat",
                   "--num-prompts", "3", "--max-tokens", "8", "--ignore-eos",
                   "--concurrency", "1,2", "--no-progress", "--keep-texts",
                   "--output", str(output))
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert json.loads(result.stdout) == report
    assert report["benchmark"] == "serve" and report["config"]["concurrency"] == [1, 2]
    assert [run["label"] for run in report["runs"]] == ["first", "second"]
    for run in report["runs"]:
        assert run["model"] == server.model  # found through /v1/models
        assert [(r["kind"], r["max_concurrency"]) for r in run["results"]] == [
            ("code", 1), ("code", 2), ("chat", 1), ("chat", 2)]  # completions, then chat
        for r in run["results"]:
            assert SUMMARY_KEYS <= set(r)
            assert (r["num_requests"], r["completed"], r["failed"]) == (3, 3, 0), r["errors"]
            assert r["total_output_tokens"] == 3 * 8  # ignore_eos: every request runs to the end
            assert r["total_input_tokens"] > 0
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                assert set(r[key]) == DISTRIBUTION_KEYS
                assert all(value is not None and value >= 0 for value in r[key].values()), key
            assert r["ttft_ms"]["p50"] < r["e2el_ms"]["p50"]
            assert r["output_throughput"] == pytest.approx(24 / r["duration_s"], rel=0.01)
            spec = r["speculative"]  # the default server speculates with n-grams
            assert spec is not None and spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
            assert spec["acceptance_rate"] is None or 0 <= spec["acceptance_rate"] <= 1
    # The same server answered the same greedy prompts alike, and each digest is its text's.
    answers = [{(r["kind"], r["max_concurrency"]): r["outputs"] for r in run["results"]}
               for run in report["runs"]]
    assert answers[0] == answers[1]
    for outputs in answers[0].values():
        assert len(outputs) == 3 and all(digest == output_digest(text) and text
                                         for _, digest, text in outputs)
    assert disagreements(throughput_cells(report), ["first", "second"]) == []
    assert figure.read_bytes().startswith(PNG_MAGIC)  # beside the JSON by default

    side_by_side = tmp_path / "compare.png"
    drawn = bench("plot", str(output), str(output), "--output", str(side_by_side))
    assert drawn.returncode == 0, drawn.stderr
    assert side_by_side.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_failed_requests_are_counted_and_the_run_goes_on(server, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    too_long = "word " * 9000  # past the default model's 8192-token context
    dataset.write_text("".join(json.dumps({"prompt": text}) + "\n"
                               for text in ("Say hi.", too_long, "Count to three.")))
    result = bench("serve", "--base-url", server.base_url, "--dataset", str(dataset),
                   "--endpoint", "completions", "--num-prompts", "3", "--max-tokens", "4",
                   "--concurrency", "3", "--request-rate", "20", "--no-progress",
                   "--plot", str(tmp_path / "fig.png"))
    assert result.returncode == 0, result.stderr
    [r] = json.loads(result.stdout)["runs"][0]["results"]
    assert (r["kind"], r["max_concurrency"], r["request_rate"]) == ("dataset", 3, 20.0)
    assert (r["num_requests"], r["completed"], r["failed"]) == (3, 2, 1)
    assert len(r["errors"]) == 1 and r["errors"][0].startswith("HTTP 400")


@pytest.mark.slow
def test_an_unknown_model_fails_before_the_run(server):
    result = bench("serve", "--base-url", server.base_url, "--model", "no-such-model",
                   "--num-prompts", "1", "--no-progress", check=False)
    assert result.returncode != 0
    assert "warm-up request failed: HTTP 404" in result.stderr
