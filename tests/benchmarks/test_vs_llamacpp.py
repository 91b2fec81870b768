"""The helpers of benchmarks/vs_llamacpp.sh: the side-by-side table, merging one report per load
level, the report's extra section, free ports, and waiting for servers that die."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from benchmarks.vs_llamacpp import (annotate, free_ports, merge_reports, summary_lines,
                                    throughput_cells, wait_ready)


def result(kind, concurrency, rate, tokens=100, completed=4, sent=4):
    return {"kind": kind, "max_concurrency": concurrency, "request_rate": "inf",
            "output_throughput": rate, "total_output_tokens": tokens, "completed": completed,
            "num_requests": sent}


def serve_report():
    return {"benchmark": "serve", "config": {"max_tokens": 128}, "runs": [
        {"label": "specserve-none", "model": "m",
         "results": [result("code", 1, 30.0), result("code", 16, 120.0, completed=3)]},
        {"label": "llama-server", "model": "m",
         "results": [result("code", 1, 20.0, tokens=98), result("code", 16, 40.0)]},
    ]}


def test_cells_group_every_server_by_workload_and_concurrency():
    cells = throughput_cells(serve_report())
    assert list(cells) == [("code", 1), ("code", 16)]
    assert cells[("code", 16)]["llama-server"]["output_throughput"] == 40.0


def test_table_shows_rates_ratios_to_llamacpp_tokens_and_failures():
    offline = {"max_tokens": 128, "repeats": 2, "results": {
        "ours/none": {"code": {"tokens_per_s": 17.0}},
        "hf/plain": {"code": {"tokens_per_s": 14.5}}}}
    lines = summary_lines(serve_report(), offline)
    row_1 = next(line for line in lines if line.startswith("code") and line.split()[1] == "1")
    row_16 = next(line for line in lines if line.startswith("code") and line.split()[1] == "16")
    assert "30.0  1.50x   100t" in row_1 and row_1.rstrip().endswith("20.0           98t")
    assert "120.0  3.00x   100t!" in row_16  # one of four requests failed
    assert any("hf/plain" in line and "code 14.5" in line for line in lines)


def test_table_without_llamacpp_has_no_ratios():
    report = serve_report()
    report["runs"] = report["runs"][:1]
    assert not any("x " in line for line in summary_lines(report)[2:])


def level_report(concurrency, num_prompts, labels=("specserve-none", "llama-server")):
    return {"benchmark": "serve", "date": "d",
            "config": {"workloads": ["code", "chat"], "concurrency": [concurrency],
                       "num_prompts": num_prompts, "max_tokens": 128},
            "runs": [{"label": label, "model": "m",
                      "results": [result(kind, concurrency, 1.0) for kind in ("code", "chat")]}
                     for label in labels]}


def test_reports_per_load_level_merge_by_server_then_workload_then_level():
    merged = merge_reports([level_report(1, 8), level_report(16, 16)])
    assert [run["label"] for run in merged["runs"]] == ["specserve-none", "llama-server"]
    assert [(r["kind"], r["max_concurrency"]) for r in merged["runs"][1]["results"]] == [
        ("code", 1), ("code", 16), ("chat", 1), ("chat", 16)]
    assert merged["config"]["concurrency"] == [1, 16]
    assert merged["config"]["num_prompts"] == [8, 16]
    assert merged["benchmark"] == "serve" and merged["config"]["max_tokens"] == 128


def test_merged_report_keeps_each_answers_digest_and_drops_its_text():
    part = level_report(1, 8)
    part["runs"][0]["results"][0]["outputs"] = [["p1", "0123abcd", "def f(): pass"]]
    merged = merge_reports([part, level_report(16, 16)])
    assert merged["runs"][0]["results"][0]["outputs"] == [["p1", "0123abcd"]]
    assert "outputs" not in merged["runs"][1]["results"][0]  # a server with none stays so


def test_reports_of_different_servers_do_not_merge():
    with pytest.raises(ValueError, match="different servers"):
        merge_reports([level_report(1, 8), level_report(16, 16, labels=("llama-server",))])


def test_extra_section_leaves_the_serve_report_intact():
    report = serve_report()
    annotated = annotate(report, {"versions": {"llama.cpp": {"llama_cpp_python": "0.3.36"}}})
    assert annotated["runs"] == report["runs"] and annotated["benchmark"] == "serve"
    assert annotated["vs_llamacpp"]["versions"]["llama.cpp"]["llama_cpp_python"] == "0.3.36"
    assert "vs_llamacpp" not in report


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_waiting_for_a_server_whose_process_exited_fails_at_once():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    [port] = free_ports(1)
    with pytest.raises(SystemExit, match="exited before it was ready"):
        wait_ready([(f"http://127.0.0.1:{port}/health", process.pid)], timeout=30)
