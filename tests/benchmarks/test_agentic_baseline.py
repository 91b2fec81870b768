"""benchmarks/agentic.py --baseline: an older tree's servers beside ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.agentic_run import Target, TurnRecord, outputs_identical, over_baseline
from benchmarks.agentic_servers import baseline_env


def test_each_method_over_its_baseline():
    """`--baseline`: a method's tokens/s over its older tree's server's, where both ran."""
    result = {"none": {"tokens_per_s": 12.0}, "none-baseline": {"tokens_per_s": 10.0},
              "suffix": {"tokens_per_s": 30.0}, "ngram": {"tokens_per_s": 20.0},
              "suffix_over_none": 2.5}
    ratios = over_baseline(dict(result))
    assert ratios["none_over_baseline"] == 1.2
    assert "suffix_over_baseline" not in ratios and "ngram_over_baseline" not in ratios
    assert over_baseline({"none": {"tokens_per_s": 0.0},
                          "none-baseline": {"tokens_per_s": 1.0}}).keys() == {"none",
                                                                               "none-baseline"}


def test_a_baseline_server_imports_the_older_tree(tmp_path):
    """The older tree's `server` and `engine` packages, not this tree's (installed editable),
    and its own kernel folder. Control: without baseline_env the same command imports ours."""
    for package in ("server", "engine"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    probe = [sys.executable, "-c", "import os, server, engine; "
             "print(server.__file__, engine.__file__, os.environ.get('SPECSERVE_CACHE_DIR'))"]

    def imported(**launch) -> list[str]:
        return subprocess.run(probe, capture_output=True, text=True, check=True,
                              **launch).stdout.split()

    older = imported(cwd=tmp_path, env={**os.environ, **baseline_env(tmp_path, "/tmp/kernels")})
    assert older == [str(tmp_path / "server" / "__init__.py"),
                     str(tmp_path / "engine" / "__init__.py"), "/tmp/kernels"]
    ours = imported(cwd=Path(__file__).resolve().parents[2])
    assert not ours[0].startswith(str(tmp_path)) and not ours[1].startswith(str(tmp_path))


def test_a_baseline_of_a_method_that_samples_its_drafts_is_exempt_on_sampled_turns():
    """`auto` samples the EAGLE head's drafts, so a seeded turn keeps the law, not the tokens:
    its sampled turns are not held to the others', and neither are its baseline's. Control: a
    greedy turn of the baseline that differs is still caught."""
    targets = [Target("none", "http://a", True), Target("auto-baseline", "http://b", True)]

    def turn(target: str, text: str, sampled: bool) -> TurnRecord:
        return TurnRecord(target, 0, 0, 5, 1.0, 5, 3, text, sampled)

    assert outputs_identical([turn("none", "a", True), turn("auto-baseline", "b", True)], targets)
    assert not outputs_identical([turn("none", "a", False), turn("auto-baseline", "b", False)],
                                 targets)
