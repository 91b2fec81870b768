"""Comparing two servers' greedy answers prompt by prompt (benchmarks/output_agreement.py), from
the digests `bench serve` records."""

from __future__ import annotations

from benchmarks.output_agreement import (digests_by_prompt, disagreements, same_weights_labels,
                                         without_texts)
from benchmarks.vs_llamacpp import throughput_cells
from specserve.bench.serving_metrics import RequestRecord, output_digest, outputs_of


def cell(kind, concurrency, answers):
    return {"kind": kind, "max_concurrency": concurrency,
            "outputs": [[prompt_id, output_digest(text), text] for prompt_id, text in answers]}


def report(none_answers, ngram_answers, float_answers=(("p1", "other weights"),)):
    return {"runs": [
        {"label": "specserve-none", "results": [cell("code", 1, none_answers)]},
        {"label": "specserve-ngram", "results": [cell("code", 1, ngram_answers)]},
        {"label": "specserve-none-float32", "results": [cell("code", 1, float_answers)]},
        {"label": "llama-server", "results": [cell("code", 1, [("p1", "llama.cpp's")])]},
    ]}


LABELS = ["specserve-none", "specserve-ngram", "specserve-none-float32", "llama-server"]


def test_only_the_gguf_specserve_servers_are_compared():
    assert same_weights_labels(LABELS) == ["specserve-none", "specserve-ngram"]


def test_equal_answers_agree_whatever_the_other_servers_said():
    answers = [("p1", "def f(): pass"), ("p2", "x = 1")]
    assert disagreements(throughput_cells(report(answers, list(reversed(answers)))),
                         same_weights_labels(LABELS)) == []


def test_one_differing_answer_is_named_with_its_cell_and_servers():
    none = [("p1", "def f(): pass"), ("p2", "x = 1")]
    ngram = [("p1", "def f(): pass"), ("p2", "x = 2")]  # the control: one token apart
    assert disagreements(throughput_cells(report(none, ngram)), same_weights_labels(LABELS)) == [
        {"workload": "code", "concurrency": 1, "servers": ["specserve-none", "specserve-ngram"],
         "prompts": ["p2"]}]


def test_a_prompt_sent_twice_compares_as_a_multiset_and_a_missing_answer_differs():
    twice = cell("code", 16, [("p1", "a"), ("p1", "b")])
    assert digests_by_prompt(twice) == {"p1": sorted([output_digest("a"), output_digest("b")])}
    none, ngram = [("p1", "a"), ("p1", "b")], [("p1", "b"), ("p1", "a"), ("p2", "c")]
    found = disagreements(throughput_cells(report(none, ngram)),
                          ["specserve-none", "specserve-ngram"])
    assert [entry["prompts"] for entry in found] == [["p2"]]


def test_texts_are_dropped_and_digests_kept():
    stripped = without_texts(report([("p1", "secret text")], [("p1", "secret text")]))
    assert stripped["runs"][0]["results"][0]["outputs"] == [["p1", output_digest("secret text")]]
    assert "secret text" not in str(stripped)


def test_records_give_digests_of_completed_answers_in_send_order():
    done = RequestRecord("p1", "code", 0.0, text="hello")
    failed = RequestRecord("p2", "code", 0.0, error="HTTP 500", text="partial")
    assert outputs_of([done, failed]) == [["p1", output_digest("hello")]]
    assert outputs_of([done], with_texts=True) == [["p1", output_digest("hello"), "hello"]]
    assert output_digest("hello") != output_digest("hello ")  # one character apart
