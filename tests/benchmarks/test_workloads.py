"""The bundled prompt sets and the user's own, as the benchmarks load them."""

from __future__ import annotations

import json

import pytest

from specserve.bench.serve import sample_workloads, workload_sets
from specserve.bench.workloads import SERVE_KINDS, load_dataset, load_workloads


@pytest.mark.parametrize("kind", SERVE_KINDS)
def test_bundled_sets_are_large_enough_to_sweep(kind):
    workloads = load_workloads(kind, 10_000)
    assert len(workloads) >= 24
    assert len({w.id for w in workloads}) == len(workloads)
    assert all(w.kind == kind and w.text.strip() for w in workloads)
    if kind != "mixed":  # code is raw completion; mixed has both (tests/benchmarks/test_mixed.py)
        assert all(w.chat == (kind != "code") for w in workloads)


def test_copy_prompts_hold_the_text_their_answer_repeats():
    for workload in load_workloads("copy", 10_000)[4:]:
        instruction, code = workload.text.split("```python\n")
        assert code.endswith("\n```") and len(code) > 100
        # the function the instruction names is defined in the code to repeat
        [function] = [n for n in instruction.split("`")[1::2] if f"def {n}(" in code]
        assert function


def test_sampling_is_seeded_and_cycles_a_small_pool():
    pool = load_workloads("chat", 5)
    first, again = sample_workloads(pool, 12, seed=3), sample_workloads(pool, 12, seed=3)
    assert first == again and len(first) == 12
    assert first[:5] == first[5:10] and set(first[:5]) == set(pool)
    assert sample_workloads(pool, 5, seed=4) != first[:5]


def test_dataset_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n\n"
                    + json.dumps({"prompt": "Sort this", "kind": "code"}) + "\n")
    workloads = load_dataset(path)
    assert [(w.kind, w.text, w.chat) for w in workloads] == [("dataset", "Hi", True),
                                                             ("code", "Sort this", True)]
    assert list(workload_sets(["code"], str(path), 3, seed=0)) == ["dataset"]
    path.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(ValueError, match="line 1 needs a string \"prompt\""):
        load_dataset(path)
