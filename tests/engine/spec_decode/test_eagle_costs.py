"""What keeps an EAGLE head's drafting cheap without changing what it drafts: its layer runs in
the compiled decoder stack beside an integer target, and a request that waits long without
drafting has its kept target rows turned into features in between (a third of their size),
without the head running."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.loader import load_model
from engine.spec_decode import eagle
from engine.spec_decode import eagle_head as eagle_head_module
from engine.spec_decode.eagle_head import load_head
from tests.conftest import make_llm, make_random_head


def test_beside_an_integer_target_the_head_layer_runs_in_the_compiled_stack(monkeypatch):
    """Catch-up rows and then a draft step through the stack equal the Python layer's (to the
    float rounding of another summation order); the control: another position differs."""
    from engine.spec_decode.factory import shipped_head

    target = load_model(None, torch.device("cpu"), torch.float32, quantization="gguf").model
    head = load_head(shipped_head("SmolLM2-135M-Instruct"), target, torch.device("cpu"),
                     torch.float32)
    torch.manual_seed(0)
    features = torch.randn(6, target.arch.hidden_size)
    embeds = target.embed(torch.randint(0, 49152, (6,))).float()

    def run(positions_from: int) -> torch.Tensor:
        cache = KVCache(head.arch, 2, 16, torch.float32, torch.device("cpu"))
        meta = build_attention_metadata([5], [positions_from + 5], [[0, 1]], 16, torch.device("cpu"))
        first = head(features[:5], embeds[:5], torch.arange(positions_from, positions_from + 5),
                     cache, meta)
        meta = build_attention_metadata([1], [positions_from + 6], [[0, 1]], 16, torch.device("cpu"))
        last = head(features[5:], embeds[5:], torch.tensor([positions_from + 5]), cache, meta)
        return torch.cat([first, last])

    built = []
    get = type(head._compiled_stack).get
    monkeypatch.setattr(type(head._compiled_stack), "get",
                        lambda self, *a: built.append(get(self, *a)) or built[-1])
    stacked = run(0)
    assert built and all(stack is not None for stack in built)
    monkeypatch.setattr(eagle_head_module, "stack_applies", lambda *a: False)
    python = run(0)
    torch.testing.assert_close(stacked, python, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(run(3), python, atol=1e-2)  # the control: rotated elsewhere


@pytest.fixture(scope="module")
def random_head(tiny_chat_model_folder, tmp_path_factory):
    return make_random_head(tiny_chat_model_folder, tmp_path_factory.mktemp("head"), 64, std=0.3,
                            feature_layers=[0, 1])


def _drafts_after_a_long_wait(model_folder, head_folder, monkeypatch, convert_rows: int,
                              wait_steps: int = 40):
    """The tokens, the first drafts of a request whose first `wait_steps` steps drafted
    nothing, and the most raw target rows it kept, with CONVERT_ROWS = `convert_rows`."""
    monkeypatch.setattr(eagle, "CONVERT_ROWS", convert_rows)
    llm = make_llm(str(model_folder), speculative_method="eagle", draft_head=str(head_folder),
                   eagle_ngram_min=0, adaptive=False, num_speculative_tokens=3)
    controller, proposer = llm.engine.controller, llm.engine.proposer
    plans, drafts, most_raw = [], [], [0]
    plan, propose, prepare = controller.plan, proposer.propose, proposer.prepare

    def holding_back(requests, max_ks, *args):
        plans.append(None)
        return [0] * len(requests) if len(plans) <= wait_steps else plan(requests, max_ks, *args)

    def recording(requests, num_tokens):
        proposal = propose(requests, num_tokens)
        drafts.append(proposal.draft_token_ids[0])
        return proposal

    def measuring(requests, max_tokens):
        prepare(requests, max_tokens)
        most_raw[0] = max(most_raw[0], *(eagle._num_raw(r) for r in requests))

    controller.plan, proposer.propose, proposer.prepare = holding_back, recording, measuring
    outputs = llm.generate(["one two three four five six"],
                           SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    return outputs[0].token_ids, drafts[:5], most_raw[0]


def test_a_long_wait_keeps_features_not_rows_and_drafts_the_same(
        tiny_chat_model_folder, random_head, monkeypatch):
    """Rows turned into features while the request waits give the drafts that turning them all
    at the draft gives, and at most CONVERT_ROWS raw rows are kept in between."""
    plain = make_llm(str(tiny_chat_model_folder), speculative_method="none").generate(
        ["one two three four five six"],
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0].token_ids
    tokens, drafts, most_raw = _drafts_after_a_long_wait(
        tiny_chat_model_folder, random_head, monkeypatch, convert_rows=8)
    whole, whole_drafts, whole_raw = _drafts_after_a_long_wait(
        tiny_chat_model_folder, random_head, monkeypatch, convert_rows=10**9)
    assert tokens == whole == plain
    assert most_raw < 8 < whole_raw  # bounded, where converting only at the draft keeps ~46
    assert drafts and drafts == whole_drafts

    # The control: a conversion that gets the features wrong (zeros) changes the drafts.
    monkeypatch.setattr(eagle.EagleProposer, "convert_long_waits",
                        lambda self, requests: _convert_to_zeros(self, requests))
    _, zeroed_drafts, _ = _drafts_after_a_long_wait(
        tiny_chat_model_folder, random_head, monkeypatch, convert_rows=8)
    assert zeroed_drafts != whole_drafts


def _convert_to_zeros(proposer, requests):
    for request in requests:
        if eagle._num_raw(request) >= eagle.CONVERT_ROWS:
            request.pending_features = [
                (first, torch.zeros(rows.shape[0], proposer.target.arch.hidden_size), True)
                for first, rows, _ in request.pending_features]
