"""Tensor parallelism through the whole engine (issue 73): at 2 ranks (a real follower process,
gloo on localhost) a tiny model's greedy tokens are transformers', as at 1 rank; every
speculative method stays lossless against `none` at 2 ranks; a model the ranks cannot split is
refused in words. (A GGUF file in Q8_0 blocks at 2 ranks: test_gguf_families.py.)"""

from __future__ import annotations

import tempfile

import pytest

from engine import SamplingParams
from tests.conftest import make_llm, make_random_head, tiny_target_and_draft

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "one two three one two three one two"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
LLAMA = dict(vocab_size=49152, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


def _generate(llm, prompts, params=GREEDY) -> tuple[list[list[int]], int]:
    """(greedy tokens, draft tokens proposed); the followers stopped after."""
    try:
        outputs = llm.generate(prompts, params)
    finally:
        if llm.engine.parallel is not None:
            llm.engine.parallel.close()
    return [o.token_ids for o in outputs], sum(o.spec_stats.num_draft_tokens for o in outputs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_folder):
    """(target, draft, transformers' greedy tokens, the prompts with a repeat, `none` at 2 ranks
    on them): a tiny Llama target and a two-layer draft, with the default model's tokenizer."""
    family = ("llama", LLAMA)
    target, draft, expected = tiny_target_and_draft(
        tmp_path_factory, default_model_folder, family, family, PROMPTS, GREEDY.max_tokens)
    plain = make_llm(str(target), speculative_method="none", tensor_parallel_size=2)
    # the first prompt, its output, the prompt again: an n-gram has a continuation at once
    prompt = plain.tokenizer(PROMPTS[0])["input_ids"]
    prompts = [*PROMPTS, prompt + expected[0] + prompt]
    none, _ = _generate(plain, prompts)
    return target, draft, expected, prompts, none


def test_two_ranks_give_transformers_tokens(tiny):
    _, _, expected, _, none = tiny
    assert none[:len(expected)] == expected


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "eagle", "layer-skip"])
def test_every_method_is_lossless_at_two_ranks(tiny, method):
    target, draft, _, prompts, none = tiny
    extra = {"draft": {"draft_model": str(draft)}, "layer-skip": {"draft_layer_ids": (0, 1)},
             "eagle": {"draft_head": make_random_head(target, tempfile.mkdtemp(prefix="head-"),
                                                      8192)}}.get(method, {})
    llm = make_llm(str(target), speculative_method=method, adaptive=False,
                   num_speculative_tokens=4, tensor_parallel_size=2, **extra)
    got, num_drafts = _generate(llm, prompts)
    assert got == none
    assert num_drafts > 0


def test_a_model_the_ranks_cannot_split_is_refused(tiny):
    target = tiny[0]  # 4 attention heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's 4 "
                                         "attention heads"):
        make_llm(str(target), speculative_method="none", tensor_parallel_size=3)


def test_tensor_parallel_settings_are_checked():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="drop --padded-steps"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, padded_steps=True)
    with pytest.raises(ValueError, match="drop --async-scheduling"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, async_scheduling=True)
    assert EngineConfig().model.tensor_parallel_size == 1  # one rank: no followers, no cuts


def test_the_flag_reaches_the_engine_config():
    from server.cli import build_parser, engine_config_from_args

    for flags, size in ((["-tp", "2"], 2), (["--tensor-parallel-size", "4"], 4), ([], 1)):
        args = build_parser().parse_args(["serve", *flags])
        assert engine_config_from_args(args).model.tensor_parallel_size == size


def test_a_second_tensor_parallel_engine_in_one_process_is_refused(tiny):
    first = make_llm(str(tiny[0]), speculative_method="none", tensor_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="one tensor-parallel engine a process"):
            make_llm(str(tiny[0]), speculative_method="none", tensor_parallel_size=2)
    finally:
        first.engine.parallel.close()


def test_a_rank_that_stops_answering_times_out(tiny, monkeypatch):
    """A follower frozen (SIGSTOP: alive, its sockets open, so nothing tells rank 0 it is gone)
    leaves rank 0's next collective to its timeout: the step raises instead of hanging."""
    import os
    import signal
    import time

    monkeypatch.setenv("SPECSERVE_TP_TIMEOUT_S", "2")
    llm = make_llm(str(tiny[0]), speculative_method="none", tensor_parallel_size=2)
    [follower] = llm.engine.parallel.processes
    os.kill(follower.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Timed out waiting 2000ms"):
            llm.generate(PROMPTS[0], GREEDY)
        assert time.monotonic() - started < 10
    finally:
        follower.kill()
        llm.engine.parallel.close()


def test_one_rank_is_the_one_process_engine(tiny):
    """--tensor-parallel-size 1 (the default): no followers, no cut, no wrapped module."""
    from engine.models.layers import Linear

    llm = make_llm(str(tiny[0]), speculative_method="none")
    model = llm.engine.runner.model
    assert llm.engine.parallel is None and model.kv_arch is model.arch
    assert all(type(m) is Linear for m in model.modules() if isinstance(m, Linear))
