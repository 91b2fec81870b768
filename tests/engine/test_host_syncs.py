"""A step reads the device once: the sampled (and accepted) tokens, in one copy.

Every other read or blocking copy would stall a GPU step on the host (the H100 profile of issue
11 counted 14 blocking copies and ~60 syncs in a verify step). Counted on whatever device runs
the tests; see tests/engine/host_syncs.py for what is counted.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.spec_decode.proposer import Proposal, Proposer
from tests.conftest import make_llm
from tests.engine.host_syncs import count_host_syncs

PROMPT = [1, 17, 42, 99, 17, 42, 7, 3, 5]
MIXED = [
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.0, top_k=20, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, presence_penalty=0.5,
                   repetition_penalty=1.2, logit_bias={5: 3.0}, ignore_eos=True),
]


class FixedDrafts(Proposer):
    """Proposes tokens 1..k, with draft distributions when `sampled` (as a draft model would)."""

    name = "fixed"

    def __init__(self, vocab_size: int, sampled: bool, device: torch.device):
        self.vocab_size, self.sampled, self.device = vocab_size, sampled, device

    def propose(self, requests, num_tokens):
        drafts = [list(range(1, k + 1)) for k in num_tokens]
        probs = None
        if self.sampled:
            probs = [torch.softmax(torch.randn(len(d), self.vocab_size, device=self.device),
                                   dim=-1) if d else None for d in drafts]
        return Proposal(drafts, probs)


@pytest.fixture(params=["fused-cpu-ops", "torch-ops"])
def ops(request, monkeypatch):
    """On CPU, layers run fused C++ ops where they can; the torch ops they replace are what CUDA
    runs, so those are counted too."""
    if request.param == "torch-ops":
        monkeypatch.setattr("engine.quant.kernels.load_kernel", lambda: None)
    return request.param


@pytest.fixture(params=["flat", "padded"])
def layout(request):
    """The flat step layout and the padded one over persistent buffers (CUDA's default)."""
    return request.param


def _engine_after_prefill(tiny_chat_model_folder, method: str, layout: str):
    llm = make_llm(str(tiny_chat_model_folder), speculative_method=method, adaptive=False,
                   num_speculative_tokens=3, padded_steps=layout == "padded")
    engine = llm.engine
    for params in MIXED:
        engine.add_request(PROMPT, params)
    engine.step()  # the prefill: chunk attention, first tokens
    return engine


def _assert_one_read(syncs, outputs):
    assert sum(len(o.delta_token_ids) for o in outputs) >= len(MIXED)  # the step did its work
    assert syncs.num_reads == 1, dict(syncs.reads)
    assert not syncs.blocking_copies, dict(syncs.blocking_copies)


def test_a_decode_step_reads_the_device_once(tiny_chat_model_folder, ops, layout):
    engine = _engine_after_prefill(tiny_chat_model_folder, "none", layout)
    with count_host_syncs() as syncs:
        outputs = engine.step()
    _assert_one_read(syncs, outputs)


@pytest.mark.parametrize("sampled", [False, True], ids=["one-hot-drafts", "sampled-drafts"])
def test_a_verify_step_reads_the_device_once(tiny_chat_model_folder, sampled, ops, layout):
    engine = _engine_after_prefill(tiny_chat_model_folder, "ngram", layout)
    engine.speculation.proposer = FixedDrafts(engine.vocab_size, sampled, engine.device)
    with count_host_syncs() as syncs:
        outputs = engine.step()
    assert engine.scheduler.spec_stats.num_draft_tokens == 3 * len(MIXED)  # drafts were verified
    _assert_one_read(syncs, outputs)


def test_the_counter_sees_what_it_must(tiny_chat_model_folder):
    """Negative control: the reads and blocking copies the step avoids are counted."""
    x = torch.arange(6)
    with count_host_syncs() as syncs:
        x[x > 2].sum()
        bool(x.any())
        torch.tensor([1, 2], device=x.device)
        x.to(x.device)
    assert syncs.num_reads == 2 and sum(syncs.blocking_copies.values()) == 2
