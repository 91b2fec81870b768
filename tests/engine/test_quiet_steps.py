"""Quiet steps (engine/spec_decode/quiet_steps.py): where drafts do not pay, a speculative engine
runs plain decode steps that overlap, and its outputs stay `none`'s."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.runner.overlap import uses_async_scheduling
from engine.spec_decode.quiet_steps import QuietSteps
from tests.conftest import make_llm
from tests.engine.test_overlap import PROMPTS, _all_blocks_free, _summary, greedy_and_seeded_cases


def test_a_quiet_run_doubles_with_each_step_without_drafts_and_ends_at_one_with_drafts():
    quiet = QuietSteps(max_run=4)
    runs = []
    for _ in range(5):
        quiet.observe(drafted_any=False)
        runs.append(quiet.left)
    assert runs == [1, 2, 4, 4, 4]
    assert quiet.ready
    quiet.take()
    assert quiet.left == 3 and quiet.num_taken == 1
    quiet.observe(drafted_any=True)  # drafts went out: every step looks for drafts again
    assert not quiet.ready and quiet.streak == 0
    quiet.observe(drafted_any=False)
    assert quiet.left == 1  # and a new run starts from one
    off = QuietSteps(max_run=0)
    off.observe(drafted_any=False)
    assert not off.ready




@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("padded", [False, True])
def test_quiet_steps_overlap_and_keep_the_outputs_of_none(tiny_chat_model_folder, method,
                                                          padded):
    folder = str(tiny_chat_model_folder)
    plain = make_llm(folder, padded_steps=padded, enforce_eager=True, speculative_method="none",
                     async_scheduling=False)
    quiet = make_llm(folder, padded_steps=padded, enforce_eager=True,
                     speculative_method=method, async_scheduling=True)
    engine = quiet.engine
    assert engine.overlap is not None and engine.speculation.quiet is not None
    for params in greedy_and_seeded_cases(24, 8, 24):
        expected = _summary(plain.generate(PROMPTS, params))
        taken, overlapped = engine.speculation.quiet.num_taken, engine.overlap.num_overlapped
        assert _summary(quiet.generate(PROMPTS, params)) == expected
        assert engine.speculation.quiet.num_taken > taken  # it did take quiet steps
        assert engine.overlap.num_overlapped > overlapped  # which overlapped
        assert _all_blocks_free(quiet)
    # (that drafts still go where they pay: test_spec_decode_engine.py, with the real model)


def test_with_no_quiet_runs_a_speculative_engine_never_overlaps(tiny_chat_model_folder):
    """The control: the same engine with quiet runs off takes none and overlaps nothing."""
    llm = make_llm(str(tiny_chat_model_folder), enforce_eager=True, speculative_method="ngram",
                   async_scheduling=True)
    llm.engine.speculation.quiet.max_run = 0
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert llm.engine.speculation.quiet.num_taken == 0
    assert llm.engine.overlap.num_overlapped == 0


def test_overlap_is_on_by_default_on_cuda_where_every_step_may_run_as_nones():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_async_scheduling(None, cuda) and not uses_async_scheduling(None, cpu)
    # quiet steps by default with a proposer that sits out; one that sees every step: never
    assert uses_async_scheduling(None, cuda, speculative=True, sits_out=True)
    assert not uses_async_scheduling(None, cuda, speculative=True)
    assert not uses_async_scheduling(None, cpu, speculative=True, sits_out=True)
    assert uses_async_scheduling(True, cpu, speculative=True)
    assert not uses_async_scheduling(False, cuda)


def test_overlap_asked_for_where_the_proposer_cannot_sit_out_is_refused(tiny_chat_model_folder):
    folder = str(tiny_chat_model_folder)
    with pytest.raises(ValueError, match="layer-skip cannot sit out"):
        make_llm(folder, speculative_method="layer-skip", draft_layer_ids=(0,),
                 async_scheduling=True)
    # left to its default it is off; asked for with a proposer that can sit out, it is on
    assert make_llm(folder, speculative_method="layer-skip", draft_layer_ids=(0,),
                    async_scheduling=None).engine.overlap is None
    assert make_llm(folder, speculative_method="ngram",
                    async_scheduling=True).engine.overlap is not None
