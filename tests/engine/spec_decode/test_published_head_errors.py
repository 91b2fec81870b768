"""A published head that does not fit the target is refused at start-up with a message that says
what differs; it is never served with wrong drafts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model
from engine.spec_decode.draft_heads import load_draft_head
from tests.conftest import make_llm, make_tiny_model
from tests.engine.spec_decode.published_heads import write_head

CPU = torch.device("cpu")
DRAFT_VOCAB = list(range(100, 612))


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, default_model_folder):
    folder = tmp_path_factory.mktemp("tiny4-errors")
    hf = make_tiny_model(folder, vocab_size=49152, num_hidden_layers=4, eos_token_id=2,
                         bos_token_id=1, tokenizer_from=default_model_folder)
    return folder, hf.config


@pytest.fixture(scope="module")
def target(tiny4):
    return load_model(str(tiny4[0]), CPU, torch.float32).model


def _head(tmp_path, tiny4, layer_ids=(1, 2, 3), config=None, **options):
    return write_head(tmp_path / "head", config or tiny4[1], DRAFT_VOCAB, list(layer_ids),
                      **options)


def _edit_tensors(folder, **changes):
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(changes)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _refused(folder, target, match):
    with pytest.raises(ValueError, match=match):
        load_draft_head(folder, target, CPU, torch.float32)


def test_a_head_for_another_hidden_size_is_refused(tmp_path, tiny4, target):
    other = copy.deepcopy(tiny4[1])
    other.hidden_size = 96  # a head trained for a wider target
    _refused(_head(tmp_path, tiny4, config=other), target,
             "reads features of hidden size 96, the target's hidden size is 64")


def test_a_wrong_target_hidden_size_key_is_refused(tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, config_overrides={"target_hidden_size": 4096}), target,
             "hidden size 4096")


def test_a_head_for_another_vocabulary_is_refused(tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, config_overrides={"vocab_size": 128256}), target,
             r"vocabulary has 128256 tokens \(vocab_size\), the target's 49152")


@pytest.mark.parametrize("name", ["midlayer.mlp.down_proj.weight", "fc.weight", "d2t",
                                  "midlayer.hidden_norm.weight"])
def test_a_missing_tensor_is_named(name, tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, drop=(name,)), target, f"lacks {name}")


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path, tiny4, target):
    folder = _edit_tensors(_head(tmp_path, tiny4), **{"fc.weight": torch.zeros(64, 128)})
    _refused(folder, target, r"fc.weight has shape \[64, 128\], expected \[64, 192\]")


def test_an_unknown_tensor_is_named(tmp_path, tiny4, target):
    folder = _edit_tensors(_head(tmp_path, tiny4), **{"midlayer.extra.weight": torch.zeros(2)})
    _refused(folder, target, "no place for: midlayer.extra.weight")


def test_d2t_outside_the_vocabulary_is_refused(tmp_path, tiny4, target):
    d2t = torch.full((len(DRAFT_VOCAB),), 100, dtype=torch.long)
    d2t[-1] = 60000
    folder = _edit_tensors(_head(tmp_path, tiny4), d2t=d2t)
    _refused(folder, target, "d2t maps draft id 511 to target id 60511, outside")


def test_d2t_mapping_two_draft_ids_to_one_token_is_refused(tmp_path, tiny4, target):
    d2t = torch.full((len(DRAFT_VOCAB),), 100, dtype=torch.long)
    d2t[1] = 99  # draft 1 -> 100, as draft 0
    _refused(_edit_tensors(_head(tmp_path, tiny4), d2t=d2t), target, "same target id")


def test_a_float_d2t_is_refused(tmp_path, tiny4, target):
    folder = _edit_tensors(_head(tmp_path, tiny4), d2t=torch.full((len(DRAFT_VOCAB),), 100.0))
    _refused(folder, target, "expected integer offsets")


def test_t2d_disagreeing_with_d2t_is_refused(tmp_path, tiny4, target):
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[:len(DRAFT_VOCAB)] = True
    _refused(_edit_tensors(_head(tmp_path, tiny4), t2d=t2d), target, "t2d marks 512")


@pytest.mark.parametrize("layer_ids", [(1, 2, 9), (0, 1, 2), (1, 1, 2)])
def test_feature_layers_the_target_cannot_give_are_refused(layer_ids, tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, layer_ids=layer_ids), target,
             r"reads target layers .* a target of 4 layers cannot give")


def test_the_default_layer_ids_outside_a_shallow_target_are_refused(tmp_path, tiny4, target):
    """Without eagle_aux_hidden_state_layer_ids: vLLM's (2, n // 2, n - 3), here (2, 2, 1)."""
    folder = _edit_config(_head(tmp_path, tiny4), eagle_config={})
    _refused(folder, target, r"target layers \[2, 2, 1\]")


def test_a_head_of_two_layers_is_refused(tmp_path, tiny4, target):
    folder = _edit_config(_head(tmp_path, tiny4), num_hidden_layers=2)
    _refused(folder, target, "2 decoder layers")


def test_a_config_that_is_not_an_eagle3_head_is_refused(tmp_path, tiny4, target):
    folder = _edit_config(_head(tmp_path, tiny4), architectures=["LlamaForCausalLM"])
    _refused(folder, target, "does not describe an EAGLE-3 head")


def test_a_speculators_head_of_another_algorithm_is_refused(tmp_path, tiny4, target):
    folder = _edit_config(_head(tmp_path, tiny4, layout="speculators"),
                          speculators_model_type="eagle")
    _refused(folder, target, "speculators model type 'eagle' is not served")


def test_a_folder_without_weights_is_refused(tmp_path, tiny4, target):
    folder = _head(tmp_path, tiny4)
    (folder / "model.safetensors").unlink()
    _refused(folder, target, "no weights")


def test_a_narrow_head_without_embeddings_is_refused(tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, hidden_size=128, with_embed=False), target,
             "lacks embed_tokens.weight and its hidden size 128 differs")


def test_an_uncached_repository_id_is_refused_without_downloading(target, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _refused("someone/not-a-cached-head", target, "neither a folder nor a repository")


def test_the_engine_refuses_a_head_that_does_not_fit_at_start(tmp_path, tiny4):
    """The path a user's --draft-head takes: the engine does not start."""
    folder = _head(tmp_path, tiny4, config_overrides={"target_hidden_size": 4096})
    with pytest.raises(ValueError, match="hidden size 4096"):
        make_llm(str(tiny4[0]), speculative_method="eagle", draft_head=str(folder))


def test_a_full_vocabulary_head_needs_no_d2t(tmp_path, tiny4, target):
    folder = write_head(tmp_path / "full", tiny4[1], list(range(49152)), [1, 2, 3],
                        drop=("d2t", "t2d"))
    head = load_draft_head(folder, target, CPU, torch.float32)
    assert head.token_ids.tolist() == list(range(49152))


def test_an_early_speculators_head_with_an_fc_bias_uses_it(tmp_path, tiny4, target):
    folder = _head(tmp_path, tiny4, layout="speculators", weights_file="model.safetensors")
    bias = torch.randn(64)
    _edit_tensors(folder, **{"fc.bias": bias})
    head = load_draft_head(folder, target, CPU, torch.float32)
    aux = torch.randn(3, 192)
    weight = load_file(str(folder / "model.safetensors"))["fc.weight"].float()
    torch.testing.assert_close(head.target_features(aux, target.norm), aux @ weight.T + bias,
                               atol=1e-4, rtol=1e-4)


def test_a_sharded_checkpoint_loads_every_shard(tmp_path, tiny4, target):
    folder = _head(tmp_path, tiny4)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    head = load_draft_head(folder, target, CPU, torch.float32)
    assert head.draft_vocab_size == len(DRAFT_VOCAB)


@pytest.mark.parametrize(("key", "value"), [("norm_before_fc", True), ("logit_scale", 0.5)])
def test_an_eagle3_variant_not_served_is_refused(key, value, tmp_path, tiny4, target):
    _refused(_head(tmp_path, tiny4, config_overrides={key: value}), target,
             f"{key} .* is an EAGLE-3 variant specserve does not serve")
