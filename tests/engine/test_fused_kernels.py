"""The fused decode/verify kernels (engine/models/skinny_gemm.py, fused_layer.py): each op and one
decoder layer against the torch path, row invariance, where the path applies, and that the
kernels compile for a Hopper GPU. On CUDA in-process; on the CPU under Triton's interpreter (a
fresh process, as the interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.engine.interpreted import ROOT, run_check

pytest.importorskip("triton")


def test_fused_ops_match_the_torch_path():
    run_check("tests.engine.fused_cases", "ops")


def test_a_rows_result_does_not_depend_on_the_other_rows():
    run_check("tests.engine.fused_cases", "invariance")


def test_a_fused_layer_matches_the_torch_layer():
    run_check("tests.engine.fused_layer_cases", "layer")


def test_a_decode_row_through_a_fused_layer_does_not_depend_on_the_other_rows():
    run_check("tests.engine.fused_layer_cases", "layer_invariance")


@pytest.fixture(scope="module")
def model_with_32_dim_heads(tmp_path_factory):
    """A tiny random Llama with two heads of 32 (the tiny chat model's heads of 16 are too
    narrow for the fused path's RoPE tiles) and a tokenizer trained in memory: nothing of the
    default model's, so a GPU machine without it runs this file whole."""
    from tests.conftest import make_tiny_model
    from tests.engine.tiny_tokenizers import train_tokenizer

    folder = tmp_path_factory.mktemp("tiny-32")
    tokenizer = train_tokenizer(normalized=False)
    make_tiny_model(folder, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.eos_token_id, num_attention_heads=2,
                    num_key_value_heads=1)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_engine_on_the_fused_path_gives_the_torch_paths_tokens(model_with_32_dim_heads):
    run_check("tests.engine.fused_layer_cases", "engine", str(model_with_32_dim_heads))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles and runs them for real")
def test_the_kernels_compile_for_a_hopper_gpu(tmp_path):
    """Triton compiles each epilogue to PTX for sm_90 without a GPU (the interpreter checks the
    arithmetic, not what only the compiler sees: types, layouts, constexpr branches); with
    programmatic dependent launch the wait is in the PTX."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "tests.engine.fused_compile"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def test_the_fused_path_takes_plain_llama_layers_only():
    from engine.models import fused_layer
    from engine.models.decoder_layer import DecoderLayer
    from engine.models.layers import Linear
    from tests.engine.fused_layer_cases import tiny_arch

    assert fused_layer.layer_allows(DecoderLayer(tiny_arch()))
    for other in (dict(qk_norm=True), dict(qkv_bias=True), dict(mlp_bias=True),
                  dict(hidden_act="gelu_pytorch_tanh"), dict(sandwich_norms=True),
                  dict(num_heads=4, num_kv_heads=2, head_dim=16)):
        assert not fused_layer.layer_allows(DecoderLayer(tiny_arch(**other))), other

    class ReducedLinear(Linear):  # as a tensor-parallel shard: its forward does more
        pass

    layer = DecoderLayer(tiny_arch())
    layer.self_attn.o_proj = ReducedLinear(64, 64)
    assert not fused_layer.layer_allows(layer)


def test_fused_kernels_are_on_for_cuda_in_bfloat16_and_off_elsewhere_or_when_asked():
    from engine.models.llama import LlamaForCausalLM
    from tests.engine.fused_layer_cases import tiny_arch

    model = LlamaForCausalLM(tiny_arch(num_layers=2))
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert model.use_fused_kernels("auto", cuda, torch.bfloat16) == 2
    assert all(layer.fused for layer in model.layers)
    assert model.use_fused_kernels("off", cuda, torch.bfloat16) == 0
    assert model.use_fused_kernels("auto", cuda, torch.float32) == 0
    assert model.use_fused_kernels("auto", torch.device("cpu"), torch.bfloat16) == 0
    assert not any(layer.fused for layer in model.layers)


def test_the_option_is_checked_and_reaches_the_config():
    from engine.config import EngineConfig
    from server.cli import build_parser, engine_config_from_args

    with pytest.raises(ValueError, match="--fused-kernels must be auto or off"):
        EngineConfig.from_kwargs(fused_kernels="on")
    # off by default until a GPU has run them (docs/performance/fused-kernels.md)
    assert EngineConfig.from_kwargs().model.fused_kernels == "off"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).model.fused_kernels \
        == "off"
    args = build_parser().parse_args(["serve", "--fused-kernels", "auto"])
    assert engine_config_from_args(args).model.fused_kernels == "auto"

