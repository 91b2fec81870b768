"""The tree bound's arithmetic: the likeliest nodes form the tree, each counted with its path's
probability, and the head's ranks are scored only below a correct path."""

from __future__ import annotations

import pytest

from benchmarks.experiments.eagle_tree_bound import TOP_K, Recorder, best_chain, best_tree, rank_rates
from engine.spec_decode.step_cost import LinearCostModel


def test_the_best_tree_takes_the_likeliest_nodes_by_path_probability():
    rates = [[0.5, 0.2, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]
    assert best_tree(rates, 1) == (0.5, 1)
    assert best_tree(rates, 2) == (pytest.approx(0.75), 2)  # the child (0.25) before rank 2 (0.2)
    assert best_tree(rates, 3) == (pytest.approx(0.95), 2)
    assert best_tree(rates, 4) == (pytest.approx(1.05), 2)  # rank 2's child: 0.2 * 0.5
    flat = LinearCostModel(1.0, 0.0)  # rows and head steps free: the bound is 1 + E
    assert best_chain(rates, 2, flat, 0.0) == {"k": 2, "expected_accepted": 0.75,
                                               "speedup_bound": 1.75}
    # The control: a row that costs a whole step halves a one-draft chain's bound.
    assert best_chain(rates, 1, LinearCostModel(0.0, 1.0), 0.0)["speedup_bound"] == 0.75


def test_ranks_are_scored_down_to_the_first_rejected_draft():
    recorder = Recorder.__new__(Recorder)
    recorder.hits = [[0] * (TOP_K + 1) for _ in range(3)]
    recorder._topk = [[7, 8, 9, 10], [1, 2, 3, 4], [5, 6, 7, 8]]
    recorder._score([7, 2])  # draft 7 accepted; then the target said 2 (rank 1): stop there
    assert recorder.hits[0][0] == 1 and recorder.hits[1][1] == 1 and sum(recorder.hits[2]) == 0
    recorder._topk = [[7, 8, 9, 10]]
    recorder._score([11])  # not among the head's top 4
    assert recorder.hits[0][TOP_K] == 1
    assert rank_rates(recorder.hits)[0] == [0.5, 0.0, 0.0, 0.0]


@pytest.mark.slow
def test_the_benchmark_runs_the_shipped_head_end_to_end(capsys):
    from benchmarks.experiments.eagle_tree_bound import main

    report = main(["--workload", "code", "--num-prompts", "1", "--max-tokens", "24",
                   "--depth", "2", "--max-nodes", "3"])
    code = report["workloads"]["code"]
    assert code["positions_scored"][0] > 5 and len(code["rank_rates"]) == 2
    assert all(0.0 <= sum(row) <= 1.0 for row in code["rank_rates"])
    assert code["step_ms"]["per_row"] > 0 and code["head_step_ms"] > 0
    assert [t["nodes"] for t in code["trees"]] == [0, 1, 2, 3]
    assert code["trees"][0]["speedup_bound"] == 1.0
