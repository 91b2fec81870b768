"""Our own head in EAGLE-3's architecture and the published layout (`train-draft --architecture
eagle3`): its dense training forward is its paged serving forward; a head trained here, written
and read back through the path a user's folder takes, drafts token for token what the head in
memory drafts, serves losslessly through vLLM's --speculative-config, and a tampered folder
drafts otherwise or is refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.loader import load_model
from engine.spec_decode import factory
from engine.spec_decode.draft_heads import load_draft_head
from engine.spec_decode.heads_published.eagle3_checkpoint import (build_head, read_spec,
                                                                  read_tensors)
from server.speculative_config_json import speculative_config_flags
from tests.conftest import make_llm, make_tiny_model
from tests.engine.spec_decode.published_heads import read_head, reference_forward, write_head
from training.eagle_train import TrainOptions, train_head
from training.trained_heads import feature_layers_for
from training.trained_heads import write_head as write_trained_head

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):\n", "one two one two one"]
NUM_DRAFTS = 3


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory, default_model_folder):
    """A tiny random 8-layer Llama (EAGLE-3 reads outputs 2, 4, 5: ids 3, 5, 6)."""
    folder = tmp_path_factory.mktemp("tiny8")
    hf = make_tiny_model(folder, vocab_size=49152, num_hidden_layers=8, eos_token_id=2,
                         bos_token_id=1, tokenizer_from=default_model_folder)
    return folder, hf


@pytest.fixture(scope="module")
def target(tiny8):
    return load_model(str(tiny8[0]), CPU, torch.float32).model


@pytest.fixture(scope="module")
def trained(tiny8, tmp_path_factory):
    """(head in memory, written folder) after a few seconds of training."""
    options = TrainOptions(architecture="eagle3", max_minutes=0.04, max_new_tokens=12,
                           max_prompts=4, disk_code_tokens=300, batch_windows=2)
    head, summary, target, name = train_head(str(tiny8[0]), options, device="cpu",
                                             log=lambda line: None)
    folder = tmp_path_factory.mktemp("eagle3-trained") / "head"
    write_trained_head(head, folder, target, name, summary)
    return head.eval(), folder


def test_the_dense_training_forward_is_the_paged_serving_forward(tiny8, target, tmp_path):
    """A catch-up over 30 positions, then one position at a time through the paged KV, gives the
    dense forward (and the published definition) at every position; the logits too. Negative
    control: the dense forward with the residual taken after hidden_norm differs."""
    folder = write_head(tmp_path / "h", tiny8[1].config, list(range(0, 49152, 12)), [3, 5, 6],
                        dtype=torch.float32, std=0.2)
    config, tensors = read_head(folder)
    dense_head = build_head(read_spec(config, folder), read_tensors(folder), target, folder)
    served = load_draft_head(folder, target, CPU, torch.float32)
    torch.manual_seed(0)
    length, hidden = 40, target.arch.hidden_size
    aux = torch.randn(length, 3 * hidden) * 3
    embeds = target.embed(torch.randint(0, 49152, (length,))).float()
    with torch.no_grad():
        dense = dense_head.train_forward(dense_head.train_first(aux)[None], embeds[None])[0]
    features = served.target_features(aux, target.norm)
    cache = KVCache(served.arch, 3, 16, torch.float32, CPU)
    meta = build_attention_metadata([30], [30], [[0, 1, 2]], 16, CPU)
    paged = [served(features[:30], embeds[:30], torch.arange(30), cache, meta)]
    for position in range(30, length):
        meta = build_attention_metadata([1], [position + 1], [[0, 1, 2]], 16, CPU)
        paged.append(served(features[position:position + 1], embeds[position:position + 1],
                            torch.tensor([position]), cache, meta))
    torch.testing.assert_close(torch.cat(paged), dense, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(dense, reference_forward(config, tensors, aux, embeds),
                               atol=2e-4, rtol=2e-4)
    with torch.no_grad():
        logits = torch.nn.functional.linear(dense_head.train_normed(dense[:5]),
                                            dense_head.lm_head.weight)
    torch.testing.assert_close(served.draft_logits(dense[:5]), logits, atol=2e-4, rtol=2e-4)
    dense_head.layer.norm_before_residual = True
    with torch.no_grad():
        wrong = dense_head.train_forward(dense_head.train_first(aux)[None], embeds[None])[0]
    assert (wrong - dense).abs().max() > 1e-2


def _feature_rows(target, head, ids: list[int]) -> tuple[torch.Tensor, int]:
    """The feature layers' raw outputs over `ids` [T, k H] and the target's greedy next token."""
    target.feature_layers = head.feature_layers
    try:
        blocks = -(-len(ids) // 16)
        cache = KVCache(target.arch, blocks, 16, torch.float32, CPU)
        meta = build_attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], 16, CPU)
        hidden = target.hidden_states(torch.tensor(ids), torch.arange(len(ids)), cache, meta)
    finally:
        target.feature_layers = ()
    size = target.arch.hidden_size
    last = target.lm_head(target.norm(hidden[-1:, :size].contiguous())).argmax(-1).item()
    return hidden[:, size:].clone(), last


@torch.no_grad()
def _dense_drafts(head, target, ids: list[int]) -> list[int]:
    """NUM_DRAFTS greedy drafts after `ids` from the head in memory, recomputed densely."""
    kept, following = _feature_rows(target, head, ids)
    features = head.train_first(kept.float())
    tokens = ids[1:] + [following]
    drafts = []
    for _ in range(NUM_DRAFTS):
        embeds = target.embed(torch.tensor(tokens)).float()
        prenorm = head.train_forward(features[None], embeds[None])[0]
        logits = torch.nn.functional.linear(head.train_normed(prenorm[-1:]), head.lm_head.weight)
        drafts.append(int(head.token_ids[logits.argmax(-1)].item()))
        features = torch.cat([features, prenorm[-1:]])
        tokens.append(drafts[-1])
    return drafts


@torch.no_grad()
def _served_drafts(head, target, ids: list[int]) -> list[int]:
    """The same drafts from a loaded head on its paged KV, one position at a time after the
    catch-up, as the proposer runs it."""
    kept, following = _feature_rows(target, head, ids)
    features = head.target_features(kept, target.norm)
    n = len(ids)
    cache = KVCache(head.arch, 4, 16, torch.float32, CPU)
    meta = build_attention_metadata([n], [n], [[0, 1, 2, 3]], 16, CPU)
    embeds = head.embed(torch.tensor(ids[1:] + [following]), target)
    prenorm = head(features, embeds, torch.arange(n), cache, meta)[-1:]
    drafts = []
    for position in range(n, n + NUM_DRAFTS):
        drafts.append(int(head.token_ids[head.draft_logits(prenorm).argmax(-1)].item()))
        if position == n + NUM_DRAFTS - 1:
            break
        meta = build_attention_metadata([1], [position + 1], [[0, 1, 2, 3]], 16, CPU)
        prenorm = head(prenorm, head.embed(torch.tensor(drafts[-1:]), target),
                       torch.tensor([position]), cache, meta)
    return drafts


def _prompt_ids(tiny8) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny8[0]))
    return [tokenizer(p)["input_ids"] for p in PROMPTS + ["x = [1, 2, 3]\nfor i in x:"]]


def test_the_written_head_is_the_published_layout(trained):
    head, folder = trained
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    assert config["draft_vocab_size"] == head.draft_vocab_size
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["midlayer.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(head.draft_vocab_size)).tolist() == \
        head.token_ids.tolist()
    assert not any(name.startswith("layers.") for name in tensors)


def test_the_head_read_back_drafts_what_the_head_in_memory_drafts(trained, tiny8, target):
    head, folder = trained
    loaded = load_draft_head(folder, target, CPU, torch.float32)
    assert loaded.feature_layers == head.feature_layers == (2, 4, 5)
    drafts = [_dense_drafts(head, target, ids) for ids in _prompt_ids(tiny8)]
    assert [_served_drafts(loaded, target, ids) for ids in _prompt_ids(tiny8)] == drafts


def test_the_head_read_back_serves_losslessly_with_the_same_acceptance(trained, tiny8,
                                                                       monkeypatch):
    """Through vLLM's --speculative-config, greedy output equals `none`'s; served from memory
    instead of the folder, every request drafts and accepts the same tokens per position."""
    head, folder = trained
    flags = speculative_config_flags(json.dumps({
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": NUM_DRAFTS}))
    model = str(tiny8[0])
    plain = make_llm(model, speculative_method="none").generate(PROMPTS, GREEDY)
    written = make_llm(model, adaptive=False, **flags).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in written] == [o.token_ids for o in plain]
    assert sum(o.spec_stats.num_draft_tokens for o in written) > 0
    monkeypatch.setattr(factory, "load_draft_head", lambda *args: head)
    in_memory = make_llm(model, adaptive=False, **flags).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in in_memory] == [o.token_ids for o in plain]
    assert [(o.spec_stats.num_draft_tokens, o.spec_stats.accepted_per_position)
            for o in in_memory] == [(o.spec_stats.num_draft_tokens,
                                     o.spec_stats.accepted_per_position) for o in written]


def test_a_tampered_folder_drafts_otherwise_or_is_refused(trained, tiny8, target, tmp_path):
    head, folder = trained
    tensors = load_file(str(folder / "model.safetensors"))
    config = (folder / "config.json").read_text()
    perturbed = tmp_path / "perturbed"
    perturbed.mkdir()
    (perturbed / "config.json").write_text(config)
    generator = torch.Generator().manual_seed(1)
    fc = tensors["fc.weight"]
    save_file({**tensors, "fc.weight": (torch.randn(fc.shape, generator=generator) * 0.3)
               .to(fc.dtype)}, str(perturbed / "model.safetensors"))
    loaded = load_draft_head(perturbed, target, CPU, torch.float32)
    ids = _prompt_ids(tiny8)
    assert [_served_drafts(loaded, target, i) for i in ids] != \
        [_dense_drafts(head, target, i) for i in ids]
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text(config)
    tensors["midlayer.mlp.upproj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    save_file(tensors, str(renamed / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks midlayer.mlp.up_proj.weight"):
        load_draft_head(renamed, target, CPU, torch.float32)


def test_heads_that_cannot_be_written_are_refused_before_training(target):
    """EAGLE-3 reads three layers, not the last only; a 3-layer target's first feature layer is
    id 1, which readers take for SpecForge's numbering."""
    from dataclasses import replace

    assert feature_layers_for("eagle3", target.arch, True) == [2, 4, 5]
    with pytest.raises(ValueError, match="--last-layer-only applies to --architecture eagle"):
        feature_layers_for("eagle3", target.arch, False)
    with pytest.raises(ValueError, match="cannot be written in the EAGLE-3 layout"):
        feature_layers_for("eagle3", replace(target.arch, num_layers=3), True)
    with pytest.raises(ValueError, match="unknown head architecture 'medusa'"):
        feature_layers_for("medusa", target.arch, True)
