"""`specserve bench` refuses bad arguments with one clear line, before sending anything."""

from __future__ import annotations

import pytest

from specserve.cli import main


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "argument --concurrency: must be > 0, got 0"),
    (["--concurrency", "4,x"], "argument --concurrency: expected a number, got 'x'"),
    (["--request-rate", "-1"], "argument --request-rate: must be > 0, got -1"),
    (["--workload", "code,poetry"], "argument --workload: unknown 'poetry'"),
    (["--endpoint", "embeddings"], "argument --endpoint: invalid choice"),
    (["--temperature", "-0.5"], "argument --temperature: must be >= 0"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--base-url", "127.0.0.1:8000"], "--base-url must start with http:// or https://"),
    (["--base-url", "http://a:1", "--base-url", "http://b:1", "--label", "x"],
     "give one --label per --base-url (2), got 1"),
    (["--base-url", "http://a:1", "--base-url", "http://b:1", "--label", "x", "--label", "x"],
     "labels must differ"),
    (["--dataset", "/no/such/file.jsonl"], "No such file"),
    (["--compare", "/no/such/report.json"], "cannot read report /no/such/report.json"),
])
def test_bad_values_fail_before_any_request(args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--no-progress", *args])
    assert str(exit_info.value).startswith("specserve bench: error: ")
    assert message in str(exit_info.value)


def test_plot_refuses_a_file_that_is_no_report(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(SystemExit, match="is not a report of specserve bench"):
        main(["bench", "plot", str(path), "--output", str(tmp_path / "x.png")])
