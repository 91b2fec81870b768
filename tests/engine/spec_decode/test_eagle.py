"""The EAGLE head: its training computation is its serving computation (EAGLE-3's feature layers
too, which the target returns beside its last layer's output), its bookkeeping of the target's
features survives recomputation, it runs Q8_0 weights beside an integer-kernel target,
`train-draft` runs end to end and resumes, and mismatched heads are refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.core.request import Request
from engine.models.loader import load_model
from engine.spec_decode.eagle import _keep_features
from engine.spec_decode.eagle_head import CONFIG_FILE, WEIGHTS_FILE, load_head, normalize_layers
from training.eagle_train import TrainOptions, train_draft
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


def _two_steps(target, ids, layer_ids=None, feature_layers=()):
    """hidden_states of a prefill of ids[:-1] and then a decode step of ids[-1], on a fresh
    cache: the two code paths (chunked prefill, the batched decode step)."""
    cpu = torch.device("cpu")
    target.feature_layers = tuple(feature_layers)
    try:
        cache = KVCache(target.arch, 2, 16, torch.float32, cpu)
        n = len(ids) - 1
        meta = build_attention_metadata([n], [n], [[0, 1]], 16, cpu)
        first = target.hidden_states(torch.tensor(ids[:-1]), torch.arange(n), cache, meta,
                                     layer_ids)
        meta = build_attention_metadata([1], [n + 1], [[0, 1]], 16, cpu)
        second = target.hidden_states(torch.tensor(ids[-1:]), torch.tensor([n]), cache, meta,
                                      layer_ids)
        return torch.cat([first, second])
    finally:
        target.feature_layers = ()


def test_feature_layers_come_back_beside_the_last_layers_output(tiny_target):
    """With feature layers (EAGLE-3) the target returns its last layer's output unchanged, then
    each feature layer's output: what running the layers up to it gives, in its order."""
    ids = [5, 17, 300, 42, 9, 1000, 77, 3, 12]
    size = tiny_target.arch.hidden_size
    assert tiny_target.arch.num_layers >= 3
    plain = _two_steps(tiny_target, ids)
    wide = _two_steps(tiny_target, ids, feature_layers=(1, 0))
    assert wide.shape == (len(ids), 3 * size)
    torch.testing.assert_close(wide[:, :size], plain, rtol=0, atol=0)
    torch.testing.assert_close(wide[:, size:2 * size], _two_steps(tiny_target, ids, [0, 1]),
                               rtol=0, atol=0)
    torch.testing.assert_close(wide[:, 2 * size:], _two_steps(tiny_target, ids, [0]),
                               rtol=0, atol=0)
    assert not torch.allclose(wide[:, size:2 * size], plain)  # the control: another layer
    # The LM head reads the last layer's output only.
    rows = torch.arange(len(ids))
    tiny_target.feature_layers = (1, 0)
    try:
        torch.testing.assert_close(tiny_target.logits(wide, rows), tiny_target.logits(plain, rows))
    finally:
        tiny_target.feature_layers = ()


def test_an_eagle3_head_serves_the_features_it_was_trained_on(tiny_chat_model_folder,
                                                             tiny_target, tmp_path):
    """The served head projects the feature layers' rows as training does (from the float16
    normalized layers training stores), and the first draft step's result agrees."""
    folder = make_random_head(tiny_chat_model_folder, tmp_path / "head", 64, std=0.3,
                              feature_layers=[0, 1])
    trained = load_head(folder, tiny_target, torch.device("cpu"), torch.float32, for_training=True)
    served = load_head(folder, tiny_target, torch.device("cpu"), torch.float32)
    assert served.feature_layers == (0, 1) and served.reduce is not None
    wide = _two_steps(tiny_target, [5, 17, 300, 42, 9], feature_layers=(0, 1))
    size = tiny_target.arch.hidden_size
    stored = normalize_layers(wide[:, size:], tiny_target.arch).half().float()
    with torch.no_grad():
        expected = trained.reduce(stored)
    torch.testing.assert_close(served.target_features(served.kept_columns(wide), tiny_target.norm), expected,
                               atol=2e-3, rtol=2e-3)
    with torch.no_grad():
        last_only = trained.reduce(normalize_layers(torch.cat([wide[:, :size]] * 2, -1),
                                                    tiny_target.arch))
    assert not torch.allclose(last_only, expected, atol=1e-2)  # the control: other layers


def test_waiting_features_are_replaced_from_a_recomputed_position():
    request = Request("r", [1, 2, 3], SamplingParams())
    _keep_features(request, 0, torch.zeros(4, 2))
    _keep_features(request, 4, torch.ones(2, 2))
    assert [(start, run.shape[0]) for start, run, _ in request.pending_features] == [(0, 4), (4, 2)]
    # After a preemption the target recomputes from position 2: positions >= 2 are replaced.
    _keep_features(request, 2, torch.full((3, 2), 7.0))
    assert [(start, run.shape[0]) for start, run, _ in request.pending_features] == [(0, 2), (2, 3)]
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
    work = tmp_path_factory.mktemp("work")
    options = TrainOptions(max_minutes=0.05, max_new_tokens=12, max_prompts=4,
                           disk_code_tokens=300, batch_windows=2, work_dir=work)
    first = train_draft(str(model), output, options, device="cpu", log=lines.append)
    # Run again with the same work folder and a longer budget: it resumes, it does not restart.
    lines.clear()
    options.max_minutes = 0.1
    summary = train_draft(str(model), output, options, device="cpu", log=lines.append)
    assert any(line.startswith("read ") and "texts.json" in line for line in lines)
    assert any(line.startswith(f"resuming from {work}") for line in lines)
    assert summary["steps"] > first["steps"] and summary["tokens"] == first["tokens"]
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


def test_beside_an_integer_target_the_head_runs_q8_0_blocks():
    """The shipped head's projections become Q8_0 on the integer kernels where the target runs
    them (--quantization gguf), and stay float32 beside gguf-exact (the control)."""
    from engine.models.layers import Linear
    from engine.spec_decode.factory import shipped_head

    folder = shipped_head("SmolLM2-135M-Instruct")
    for quantization, formats in (("gguf", {"Q8_0x16"}), ("gguf-exact", set())):
        target = load_model(None, torch.device("cpu"), torch.float32,
                            quantization=quantization).model
        head = load_head(folder, target, torch.device("cpu"), torch.float32)
        linears = [m for m in head.modules() if isinstance(m, Linear)]
        assert {f for m in linears if m.gguf for f in m.gguf.format_names} == formats
        assert all((m.gguf is not None) == bool(formats) for m in linears)
