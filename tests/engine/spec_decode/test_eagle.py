"""The EAGLE head: its training computation is its serving computation, its bookkeeping of the
target's features survives recomputation, `train-draft` runs end to end, and mismatched heads
are refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.kv_cache import KVCache
from engine.models.loader import load_model
from engine.request import Request
from engine.spec_decode.eagle import _keep_features
from engine.spec_decode.eagle_head import CONFIG_FILE, WEIGHTS_FILE, load_head
from engine.spec_decode.eagle_train import TrainOptions, train_draft
from tests.conftest import make_llm, make_random_head, make_tiny_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):\n", "one two one two one"]


@pytest.fixture(scope="module")
def tiny_target(tiny_chat_model_folder):
    return load_model(str(tiny_chat_model_folder), torch.device("cpu"), torch.float32).model


def test_training_forward_equals_the_paged_serving_forward(tiny_chat_model_folder, tiny_target,
                                                            tmp_path):
    """A catch-up over 30 positions and then one position at a time, through the paged KV, gives
    the dense causal training forward's result at every position."""
    folder = make_random_head(tiny_chat_model_folder, tmp_path / "head", 64, std=0.3)
    head = load_head(folder, tiny_target, torch.device("cpu"), torch.float32, for_training=True)
    served = load_head(folder, tiny_target, torch.device("cpu"), torch.float32)
    length, hidden = 40, tiny_target.arch.hidden_size
    torch.manual_seed(0)
    features = torch.randn(length, hidden)
    embeds = tiny_target.embed(torch.randint(0, 49152, (length,))).float()
    with torch.no_grad():
        dense = head.train_forward(features[None], embeds.clone()[None])[0]
    cache = KVCache(served.arch, 3, 16, torch.float32, torch.device("cpu"))
    meta = build_attention_metadata([30], [30], [[0, 1, 2]], 16, torch.device("cpu"))
    paged = [served(features[:30], embeds[:30], torch.arange(30), cache, meta)]
    for position in range(30, length):
        meta = build_attention_metadata([1], [position + 1], [[0, 1, 2]], 16, torch.device("cpu"))
        paged.append(served(features[position:position + 1], embeds[position:position + 1],
                            torch.tensor([position]), cache, meta))
    torch.testing.assert_close(torch.cat(paged), dense, atol=1e-4, rtol=1e-4)
    # The logits too: the served head packs its LM head rows, training reads them plain.
    torch.testing.assert_close(served.draft_logits(dense[:3]), head.train_logits(dense[:3]),
                               atol=1e-4, rtol=1e-4)


def test_waiting_features_are_replaced_from_a_recomputed_position():
    request = Request("r", [1, 2, 3], SamplingParams())
    _keep_features(request, 0, torch.zeros(4, 2))
    _keep_features(request, 4, torch.ones(2, 2))
    assert [(start, run.shape[0]) for start, run in request.pending_features] == [(0, 4), (4, 2)]
    # After a preemption the target recomputes from position 2: positions >= 2 are replaced.
    _keep_features(request, 2, torch.full((3, 2), 7.0))
    assert [(start, run.shape[0]) for start, run in request.pending_features] == [(0, 2), (2, 3)]
    assert request.pending_features[1][1][0, 0] == 7.0


def test_a_head_for_another_model_is_refused(tmp_path, tiny_target, default_model_folder):
    folder = make_random_head(default_model_folder, tmp_path / "head", 16)
    with pytest.raises(ValueError, match="trained for another model"):
        load_head(folder, tiny_target, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="not a draft head folder"):
        load_head(tmp_path, tiny_target, torch.device("cpu"), torch.float32)


def test_a_model_without_a_shipped_head_names_train_draft(tiny_chat_model_folder):
    with pytest.raises(ValueError, match="specserve train-draft"):
        make_llm(str(tiny_chat_model_folder), speculative_method="eagle")


def test_the_shipped_head_is_found_by_the_model_name():
    from engine.spec_decode.factory import shipped_head

    assert shipped_head("SmolLM2-135M-Instruct") is not None
    # the default model's converted folder, `<file stem>-<hash>`
    assert shipped_head("SmolLM2-135M-Instruct.Q4_1-080b8b61654a") is not None
    assert shipped_head("some-other-model") is None


def test_train_draft_smoke_on_a_tiny_model(tmp_path_factory, default_model_folder):
    """Data from the target's own answers and source on disk, training, held-out acceptance,
    and a written head that then serves losslessly."""
    model = tmp_path_factory.mktemp("tiny-train")
    make_tiny_model(model, vocab_size=49152, tokenizer_from=default_model_folder,
                    eos_token_id=2, bos_token_id=1, num_hidden_layers=2)
    output = tmp_path_factory.mktemp("trained") / "head"
    lines = []
    options = TrainOptions(max_minutes=0.05, max_new_tokens=12, max_prompts=4,
                           disk_code_tokens=300, batch_windows=2)
    summary = train_draft(str(model), output, options, device="cpu", log=lines.append)
    assert (output / WEIGHTS_FILE).is_file() and (output / CONFIG_FILE).is_file()
    assert summary["steps"] >= 1 and summary["tokens"] > 100
    assert 0.0 <= summary["held_out_acceptance"] <= 1.0
    assert summary["overlap"]["benchmark_files_found"]
    assert any("held-out acceptance" in line for line in lines)
    assert any(line.startswith("overlap with HumanEval/MT-Bench") for line in lines)
    config = json.loads((output / CONFIG_FILE).read_text())
    assert config["training"]["held_out_acceptance"] == summary["held_out_acceptance"]
    plain = make_llm(str(model), speculative_method="none").generate(PROMPTS, GREEDY)
    eagle = make_llm(str(model), speculative_method="eagle", draft_head=str(output),
                     adaptive=False, num_speculative_tokens=3).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in eagle] == [o.token_ids for o in plain]
    assert sum(o.spec_stats.num_draft_tokens for o in eagle) > 0
