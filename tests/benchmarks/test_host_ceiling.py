"""The benchmark-only stub forward (engine/runner/stub_runner.py) and benchmarks/host_ceiling.py:
the stub is off unless its switch is set, serves the walking text when it is, hooks into a tree
that predates it, and the benchmark measures this tree beside such a tree end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.host_ceiling import MODEL_RUNNER_LINE, install_stub
from engine import SamplingParams
from engine.runner.model_runner import ModelRunner
from engine.runner.stub_runner import (
    STUB_FORWARD_ENV,
    STUB_TEXT,
    StubForwardRunner,
    flat_runner,
)
from tests.conftest import make_llm

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "40bdf22"  # main before the stub: its engine builds ModelRunner itself
PROMPT = "Tell me about the sea."
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _stub_ids(llm, prompt_ids: list[int], count: int) -> list[int]:
    text_ids = llm.engine.tokenizer(STUB_TEXT, add_special_tokens=False)["input_ids"]
    return [text_ids[(len(prompt_ids) + k) % len(text_ids)] for k in range(count)]


@pytest.mark.parametrize("setting", [None, "0", "yes"])
def test_the_stub_is_off_unless_its_switch_says_1(tiny_chat_model_folder, monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(STUB_FORWARD_ENV, raising=False)
    else:
        monkeypatch.setenv(STUB_FORWARD_ENV, setting)
    llm = make_llm(str(tiny_chat_model_folder), speculative_method="none")
    assert type(llm.engine.runner) is ModelRunner
    [out] = llm.generate([PROMPT], PARAMS)
    assert out.token_ids != _stub_ids(llm, out.prompt_token_ids, 12)  # the model's own


def test_the_stub_serves_the_walking_text_when_asked(tiny_chat_model_folder, monkeypatch):
    """Negative control of the test above: the same check sees the stub when it runs."""
    monkeypatch.setenv(STUB_FORWARD_ENV, "1")
    llm = make_llm(str(tiny_chat_model_folder), speculative_method="none", device="cpu")
    assert type(llm.engine.runner) is StubForwardRunner
    outs = llm.generate([PROMPT, PROMPT + " And the sky."],
                        SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True,
                                       logprobs=1))
    for out in outs:
        assert out.token_ids == _stub_ids(llm, out.prompt_token_ids, 12)
        assert out.text in STUB_TEXT + STUB_TEXT  # ordinary text, decoded for real
        assert all(lp.logprob > -1e-3 for lp in out.logprobs)  # finite: JSON can carry them


def test_the_stub_refuses_a_device_step(monkeypatch):
    monkeypatch.setenv(STUB_FORWARD_ENV, "1")
    with pytest.raises(ValueError, match="--device cpu"):
        flat_runner(None, None, None, torch.device("cuda"))


def test_install_stub_hooks_a_tree_that_predates_it(tmp_path):
    tree = tmp_path / "tree"
    (tree / "engine" / "runner").mkdir(parents=True)
    old_engine = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE}:engine/engine.py"],
                                check=True, capture_output=True, text=True).stdout
    assert MODEL_RUNNER_LINE in old_engine
    (tree / "engine" / "engine.py").write_text(old_engine)
    install_stub(tree)
    hooked = (tree / "engine" / "engine.py").read_text()
    assert MODEL_RUNNER_LINE not in hooked and "flat_runner(config, loaded" in hooked
    compile(hooked, "engine.py", "exec")
    assert (tree / "engine" / "runner" / "stub_runner.py").read_text() == \
        (ROOT / "engine" / "runner" / "stub_runner.py").read_text()
    assert "flat_runner(config, loaded" in (ROOT / "engine" / "engine.py").read_text()
    (tree / "engine" / "engine.py").write_text("runner = Something()\n")  # no line to hook
    with pytest.raises(RuntimeError, match="no line building the flat runner"):
        install_stub(tree)


def test_host_ceiling_report(tmp_path, tiny_chat_model_folder):
    output = tmp_path / "ceiling.json"
    subprocess.run([sys.executable, "-m", "benchmarks.host_ceiling", "--baseline", BASELINE,
                    "--model", str(tiny_chat_model_folder), "--concurrency", "4",
                    "--num-requests", "4", "--max-tokens", "8", "--repeats", "1",
                    "--output", str(output)], cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    report = json.loads(output.read_text())
    assert report["machine"]["cpu"] and report["config"]["baseline"] == BASELINE
    for tree in ("this", "baseline"):
        cell = report["median"][tree]
        assert cell["failed"] == 0 and cell["output_tokens_per_s"] > 0
        assert 0 < cell["chunks_per_token"] <= 1 and cell["ttft_p99_ms"] >= cell["ttft_p50_ms"]
    assert report["outputs_agree_across_trees_and_rounds"]  # the same stub in both trees
    assert report["this_over_baseline_tokens_per_s"] > 0
