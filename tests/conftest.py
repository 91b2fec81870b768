"""Shared fixtures: the embedded default model (converted once per machine) and tiny random
models that load in milliseconds."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Before torch: `engine` chooses how OpenMP's workers wait before torch loads its runtime (see
# engine/__init__.py), and the servers that tests start inherit the same setting, as users' do.
import engine  # noqa: E402, F401  # isort: skip
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.core.memory import CPU_KV_CACHE_GIB  # noqa: E402


# The device engine-level tests run on: the accelerator when there is one (override with
# SPECSERVE_TEST_DEVICE=cpu), so `make test` on a GPU machine tests the GPU path.
TEST_DEVICE = torch.device(os.environ.get("SPECSERVE_TEST_DEVICE")
                           or ("cuda" if torch.cuda.is_available() else "cpu"))
# Devices that device-generic unit tests (models, sampler) run on: the CPU and the accelerator.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# The KV budget of every test engine, on any device: the CPU's default. On a GPU an engine
# otherwise claims --gpu-memory-utilization (0.9) of the whole card, and a second engine in the
# process, or a second server, is refused at start (as vLLM refuses it).
TEST_KV_CACHE_GIB = CPU_KV_CACHE_GIB


# The quantization whose logits equal transformers' on the same weights: on CPU the GGUF blocks
# with float32 activations (auto would take the integer kernels, llama.cpp's arithmetic, which
# is close to the float model but not equal to it); elsewhere auto dequantizes.
EXACT_QUANTIZATION = "gguf-exact" if TEST_DEVICE.type == "cpu" else "auto"


def make_llm(model: str | None = None, **options):
    """An LLM on TEST_DEVICE, in float32 unless a test asks otherwise: tests compare against
    transformers' float32 results or against the engine's own non-speculative output, and
    bfloat16 is neither exact nor batch-invariant (docs/speculative-decoding.md, "Lossless, precisely"). Its KV cache
    is TEST_KV_CACHE_GIB unless the test sizes it."""
    from engine import LLM

    options.setdefault("device", str(TEST_DEVICE))
    options.setdefault("dtype", "float32")
    if "gpu_memory_utilization" not in options:
        options.setdefault("kv_cache_memory_gib", TEST_KV_CACHE_GIB)
    return LLM(model, **options)


@pytest.fixture(scope="session")
def default_model_folder():
    """Hugging Face folder of the embedded SmolLM2-135M-Instruct (dequantized from its GGUF)."""
    from engine.models.loader import resolve_model_folder

    folder, _name = resolve_model_folder(None)
    return folder


@pytest.fixture(scope="session")
def server():
    """`specserve serve` with no arguments (the default model, ngram speculation), shared."""
    from tests.servers import DEFAULT_MODEL, running_server

    with running_server([], DEFAULT_MODEL) as running:
        yield running


@pytest.fixture(scope="session")
def default_llm():
    return make_llm()


def make_random_head(model_folder, folder, draft_vocab_size: int, seed: int = 0,
                     std: float = 0.02, feature_layers: list[int] | None = None):
    """Saves an untrained EAGLE head for the model in `model_folder` (its first
    `draft_vocab_size` token ids as the draft vocabulary; EAGLE-3 with `feature_layers`) and
    returns the folder."""
    from dataclasses import asdict
    from pathlib import Path

    from transformers import AutoConfig

    from engine.models.architecture import LlamaArchitecture
    from engine.spec_decode.eagle_head import EagleHead, EagleHeadConfig

    arch = LlamaArchitecture.from_hf_config(AutoConfig.from_pretrained(model_folder))
    head = EagleHead(arch, draft_vocab_size, feature_layers)
    head.init_weights(torch.Generator().manual_seed(seed), std=std)
    head.token_ids.copy_(torch.arange(draft_vocab_size))
    head.save(Path(folder), EagleHeadConfig(asdict(arch), draft_vocab_size, "random",
                                            feature_layers=feature_layers))
    return folder


def make_tiny_model(folder, model_type: str = "llama", tokenizer_from=None, **overrides):
    """Saves a small random model of the given family to `folder` and returns the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    # Eager attention where scores are soft-capped: some transformers releases (5.17) pick SDPA
    # for Gemma 2 and silently drop the soft-cap there, so the reference would not be Gemma 2.
    softcapped = getattr(config, "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager" if softcapped else None)
    # Random init leaves tiny weights; scale up so logits differ by more than float noise.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.15)
        # Norm weights off their initial value (1, or Gemma's 0 applied as 1 + 0), so a norm
        # weight read wrongly changes the output.
        for name, param in model.named_parameters():
            if param.dim() == 1 and name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return model


def transformers_greedy(hf_model, folder, prompts, max_tokens: int) -> list[list[int]]:
    """transformers generate(), greedy, one prompt at a time, EOS ignored: the reference
    outputs of a tiny model saved with a tokenizer in `folder`. Asserts the prompts steer it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert len({tuple(e) for e in expected}) == len(prompts)
    return expected


def tiny_target_and_draft(tmp_path_factory, tokenizer_from, target: tuple[str, dict],
                          draft: tuple[str, dict], prompts, max_tokens: int):
    """(target folder, draft folder, transformers' greedy outputs of the target): two tiny
    models, (model_type, settings) each, with the default model's tokenizer; the draft has two
    layers."""
    folders = []
    for (model_type, settings), role in ((target, "target"), (draft, "draft")):
        folder = tmp_path_factory.mktemp(f"{model_type}-{role}")
        layers = {"num_hidden_layers": 2} if role == "draft" else {}
        hf_model = make_tiny_model(folder, model_type, tokenizer_from=tokenizer_from,
                                   **{**settings, **layers})
        folders.append((folder, hf_model))
    (target_folder, hf_target), (draft_folder, _) = folders
    return target_folder, draft_folder, transformers_greedy(hf_target, target_folder, prompts,
                                                            max_tokens)


def assert_alone_and_batched(llm, prompts, expected, params) -> None:
    """Each prompt alone, then all in one batch, give `expected`."""
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def assert_lossless(target, draft, method: str, prompts, expected, params, **options):
    """Greedy `method` on the tiny `target` gives the outputs `expected` of `prompts`, and the
    `none` output of one more prompt (the first prompt, its output, the prompt again: a random
    model rarely repeats its prompt, and there the n-gram lookup has a continuation at once);
    and drafts were really proposed. `draft`: the draft model's folder for method "draft";
    method "eagle" drafts with an untrained head for the target (rejected almost always)."""
    import tempfile

    extra = {"ngram": {}, "layer-skip": {"draft_layer_ids": (0, 2)},
             "draft": {"draft_model": str(draft)}}.get(method, {})
    if method == "eagle":
        extra = {"draft_head": make_random_head(target, tempfile.mkdtemp(prefix="head-"), 8192)}
    llm = make_llm(str(target), speculative_method=method, adaptive=False,
                   num_speculative_tokens=4, **extra, **options)
    prompt = llm.tokenizer(prompts[0])["input_ids"]
    repeated = prompt + expected[0] + prompt
    plain = make_llm(str(target), speculative_method="none", **options)
    outputs = llm.generate([*prompts, repeated], params)
    assert [o.token_ids for o in outputs] == [*expected,
                                              plain.generate(repeated, params)[0].token_ids]
    assert sum(o.spec_stats.num_draft_tokens for o in outputs) > 0


@pytest.fixture(scope="session")
def tiny_chat_model_folder(tmp_path_factory, default_model_folder):
    """A tiny random Llama with the default model's tokenizer: the whole engine, in milliseconds."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model(folder, vocab_size=49152, tokenizer_from=default_model_folder,
                    eos_token_id=2, bos_token_id=1)
    return folder
