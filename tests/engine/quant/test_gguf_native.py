"""The default model loaded natively from its GGUF file: packed weights, the same logits and
greedy tokens as the dequantized float32 model, on the kernel and on the pure-torch fallback."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.gguf_native import hf_tensor_name, rope_unpermute_rows
from engine.models.layers import Linear
from engine.models.loader import default_model_path, keeps_gguf_blocks, load_model

CPU = torch.device("cpu")
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def test_tensor_names_map_to_hugging_face_names():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    assert hf_tensor_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="no place"):
        hf_tensor_name("blk.0.ffn_bogus.weight")
    with pytest.raises(ValueError, match="no place"):  # a Gemma norm in a llama file
        hf_tensor_name("blk.0.post_ffw_norm.weight")
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma2") == \
        "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.1.ffn_up_exps.weight", "qwen3moe") == \
        "model.layers.1.mlp.experts.{expert}.up_proj.weight"


def test_rope_unpermute_is_a_permutation_that_splits_interleaved_pairs():
    rows = rope_unpermute_rows(16, 2)  # 2 heads of 8 rows: pairs (0,1),(2,3).. -> halves
    assert sorted(rows.tolist()) == list(range(16))
    assert rows[:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_quantization_modes_choose_and_refuse_with_reasons(tmp_path):
    gguf_file = default_model_path()
    assert keeps_gguf_blocks(gguf_file, CPU, torch.float32, "auto")
    assert keeps_gguf_blocks(gguf_file, CPU, torch.float32, "gguf")
    assert not keeps_gguf_blocks(gguf_file, CPU, torch.float32, "none")
    assert not keeps_gguf_blocks(gguf_file, torch.device("cuda"), torch.bfloat16, "auto")
    assert not keeps_gguf_blocks(tmp_path, CPU, torch.float32, "auto")  # a folder
    with pytest.raises(ValueError, match="needs a .gguf model"):
        keeps_gguf_blocks(tmp_path, CPU, torch.float32, "gguf")
    with pytest.raises(ValueError, match="CPU only"):
        keeps_gguf_blocks(gguf_file, torch.device("cuda"), torch.float32, "gguf")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        keeps_gguf_blocks(gguf_file, CPU, torch.float32, "int4")


def _prompt_logits(model, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    num_blocks = (len(token_ids) + 15) // 16
    kv = KVCache(model.arch, num_blocks, 16, torch.float32, CPU)
    meta = build_attention_metadata([len(token_ids)], [len(token_ids)], [list(range(num_blocks))],
                                    16, CPU)
    n = len(token_ids)
    return model(torch.tensor(token_ids), torch.arange(n), kv, meta, torch.arange(n))


@pytest.mark.slow
def test_native_model_keeps_blocks_and_matches_the_float_model():
    native = load_model(None, CPU, torch.float32, quantization="gguf-exact")
    dense = load_model(None, CPU, torch.float32, with_tokenizer=False, quantization="none")
    linears = [m for m in native.model.modules() if isinstance(m, Linear)]
    assert all(m.gguf is not None and m.weight.numel() == 0 for m in linears)
    assert native.model.gguf_format_names() == ["Q4_1", "Q8_0"]
    assert 90e6 < native.model.gguf_bytes() < 100e6  # the file's 96 MB, no float copy beside
    token_ids = native.tokenizer(PROMPT)["input_ids"]
    ours, reference = _prompt_logits(native.model, token_ids), _prompt_logits(dense.model,
                                                                              token_ids)
    assert ((ours - reference).norm() / reference.norm()).item() <= 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.fixture
def native_llm(default_llm):
    """The shared default-model engine, which runs native GGUF blocks only on a CPU."""
    if default_llm.engine.device.type != "cpu":
        pytest.skip("native GGUF blocks are CPU code; the tests' engine runs elsewhere")
    return default_llm


@pytest.mark.slow
def test_fallback_path_gives_the_kernels_tokens(monkeypatch, native_llm):
    greedy = SamplingParams(max_tokens=6, temperature=0)
    expected = native_llm.generate([PROMPT], greedy)[0].token_ids
    monkeypatch.setattr("engine.quant.gguf_weight.load_kernel", lambda: None)
    assert native_llm.generate([PROMPT], greedy)[0].token_ids == expected


@pytest.mark.slow
def test_float_path_still_serves_the_gguf_file(native_llm):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    dense = LLM(quantization="none", speculative_method="none", num_kv_blocks=16, device="cpu")
    assert all(m.gguf is None for m in dense.engine.runner.model.modules()
               if isinstance(m, Linear))
    exact = LLM(quantization="gguf-exact", speculative_method="none", num_kv_blocks=16,
                device="cpu")
    assert dense.generate([PROMPT], greedy)[0].token_ids == \
        exact.generate([PROMPT], greedy)[0].token_ids


@pytest.mark.slow
def test_the_dequantized_folder_equals_transformers_own_conversion(default_model_folder):
    """The float folder (this project's reader: names, llama.cpp's q/k permutation undone,
    blocks dequantized by the gguf package) holds transformers' own conversion of the file,
    tensor for tensor and bit for bit. Control: a q_proj left permuted differs."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ours = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).state_dict()
    state = ours.state_dict()
    assert sorted(state) == sorted(reference)
    assert all(torch.equal(state[name], reference[name]) for name in reference)
    q_proj = reference["model.layers.0.self_attn.q_proj.weight"]
    permuted = q_proj[rope_unpermute_rows(q_proj.shape[0], ours.config.num_attention_heads)]
    assert not torch.equal(permuted, q_proj)
