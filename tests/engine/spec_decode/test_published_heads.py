"""Published EAGLE-3 heads (EAGLE / SpecForge and `speculators` layouts), written by the tests as
the formats define them and loaded through the path a user's --draft-head folder takes: the
served head computes the published definition, the target hands over the layers the config
names, greedy output equals `none`'s, a fitted head is accepted often where the same head with a
scrambled d2t is accepted rarely (and stays lossless)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.models.loader import load_model
from engine.spec_decode.draft_heads import load_draft_head
from tests.conftest import make_llm, make_tiny_model
from tests.engine.spec_decode.published_heads import (read_head, reference_draft_logits,
                                                      reference_forward, write_head)

CPU = torch.device("cpu")
# Residual-stream boundaries as vLLM counts them: the stream after 2, 3 and 4 of the 5 layers.
LAYER_IDS = [2, 3, 4]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):\n", "one two one two one"]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, default_model_folder):
    """A tiny random 5-layer Llama with the default tokenizer: (folder, transformers model)."""
    folder = tmp_path_factory.mktemp("tiny5")
    hf = make_tiny_model(folder, vocab_size=49152, num_hidden_layers=5, eos_token_id=2,
                         bos_token_id=1, tokenizer_from=default_model_folder)
    return folder, hf


@pytest.fixture(scope="module")
def target(tiny4):
    return load_model(str(tiny4[0]), CPU, torch.float32).model


@pytest.fixture(scope="module")
def plain_outputs(tiny4):
    llm = make_llm(str(tiny4[0]), speculative_method="none")
    return [(o.prompt_token_ids, o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _draft_vocab(size: int, seed: int = 0) -> list[int]:
    """`size` target ids in increasing order, spread over the vocabulary (d2t offsets vary)."""
    ids = torch.randperm(49152, generator=torch.Generator().manual_seed(seed))[:size]
    return sorted(ids.tolist())


VARIANTS = {
    # EAGLE / SpecForge: bfloat16 safetensors, no embeddings (the target's)
    "eagle3": dict(layout="eagle3"),
    "eagle3-norm-before-residual": dict(layout="eagle3",
                                        config_overrides={"norm_before_residual": True}),
    # no lm_head: the target's LM head rows of the draft vocabulary
    "eagle3-no-lm-head": dict(layout="eagle3", with_lm_head=False),
    # speculators: its own embeddings, a wider head than the target, a pytorch_model.bin
    "speculators": dict(layout="speculators", hidden_size=128, weights_file="pytorch_model.bin",
                        dtype=torch.float16),
}


def _write(folder, tiny4, variant: str, draft_vocab: list[int] | None = None, **options):
    return write_head(folder, tiny4[1].config, draft_vocab or _draft_vocab(4096), LAYER_IDS,
                      **{**VARIANTS[variant], **options})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_served_head_computes_the_published_definition(variant, tiny4, target, tmp_path):
    """A catch-up over 30 positions and then one position at a time through the paged KV give
    the dense definition's pre-norm output at every position, and its draft logits."""
    folder = _write(tmp_path / variant, tiny4, variant)
    head = load_draft_head(folder, target, CPU, torch.float32)
    config, tensors = read_head(folder)
    torch.manual_seed(0)
    length = 40
    aux = torch.randn(length, len(LAYER_IDS) * target.arch.hidden_size) * 3
    next_ids = torch.randint(0, 49152, (length,))
    embeds = head.embed(next_ids, target).float()
    expected = reference_forward(config, tensors, aux, embeds)
    features = head.target_features(aux, target.norm)
    cache = KVCache(head.arch, 3, 16, torch.float32, CPU)
    meta = build_attention_metadata([30], [30], [[0, 1, 2]], 16, CPU)
    served = [head(features[:30], embeds[:30], torch.arange(30), cache, meta)]
    for position in range(30, length):
        meta = build_attention_metadata([1], [position + 1], [[0, 1, 2]], 16, CPU)
        served.append(head(features[position:position + 1], embeds[position:position + 1],
                           torch.tensor([position]), cache, meta))
    torch.testing.assert_close(torch.cat(served), expected, atol=2e-4, rtol=2e-4)
    lm_head = None if "lm_head.weight" in tensors else target.lm_head.embedding(head.token_ids)
    torch.testing.assert_close(head.draft_logits(expected),
                               reference_draft_logits(config, tensors, expected, lm_head),
                               atol=2e-4, rtol=2e-4)
    assert head.token_ids.tolist() == (tensors["d2t"] + torch.arange(4096)).tolist()


def _layer_outputs(hf, ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's output (before the final norm) in transformers, by forward hooks."""
    outputs = {}
    hooks = [layer.register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple)
                                                           else out))
        for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return [outputs[i].reshape(len(ids), -1) for i in range(len(hf.model.layers))]


@pytest.mark.parametrize(("layout", "layer_ids", "outputs_read"), [
    ("eagle3", [2, 3, 4], [1, 2, 3]),  # boundaries: the stream after 2, 3, 4 layers
    ("eagle3", [2, 3, 5], [1, 2, 4]),  # 5: the last layer's output, before the final norm
    ("eagle3", [1, 2, 3], [1, 2, 3]),  # SpecForge's layer outputs (ids from 1), as SGLang reads
    ("speculators", [1, 2, 3], [0, 1, 2]),  # vLLM's own format: boundaries always
])
def test_the_target_hands_over_the_layers_the_ids_name(layout, layer_ids, outputs_read, tiny4,
                                                        target, tmp_path):
    folder = write_head(tmp_path / "h", tiny4[1].config, _draft_vocab(4096), layer_ids,
                        layout=layout)
    head = load_draft_head(folder, target, CPU, torch.float32)
    assert head.feature_layers == tuple(outputs_read)
    ids = [5, 17, 300, 42, 9, 1000, 77]
    target.feature_layers = head.feature_layers
    try:
        cache = KVCache(target.arch, 2, 16, torch.float32, CPU)
        meta = build_attention_metadata([len(ids)], [len(ids)], [[0, 1]], 16, CPU)
        hidden = target.hidden_states(torch.tensor(ids), torch.arange(len(ids)), cache, meta)
    finally:
        target.feature_layers = ()
    outputs = _layer_outputs(tiny4[1], ids)
    expected = torch.cat([outputs[i] for i in outputs_read], dim=-1)
    torch.testing.assert_close(head.kept_columns(hidden), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_output_with_a_published_head_equals_none(variant, tiny4, plain_outputs,
                                                         tmp_path):
    folder = _write(tmp_path / variant, tiny4, variant)
    llm = make_llm(str(tiny4[0]), speculative_method="eagle", draft_head=str(folder),
                   adaptive=False, num_speculative_tokens=4, eagle_ngram_min=0)
    one_at_a_time = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in one_at_a_time] == [out for _, out in plain_outputs]
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == [out for _, out in plain_outputs]
    assert sum(o.spec_stats.num_draft_tokens for o in one_at_a_time + batched) > 100


def _fitted_head(folder, tiny4, plain_outputs, scrambled: bool = False):
    """A speculators-layout head whose lm_head is fitted (least squares) so that its first draft
    after each position of the greedy outputs is the target's token two ahead: accepted often on
    these prompts. `scrambled`: the same head with d2t permuted, its drafts other tokens."""
    sequences = [prompt + out for prompt, out in plain_outputs]
    vocab = sorted({t for s in sequences for t in s})
    vocab += [t for t in _draft_vocab(64, seed=1) if t not in vocab][:64 - len(vocab) % 64]
    vocab = sorted(vocab)
    write_head(folder, tiny4[1].config, vocab, LAYER_IDS, layout="speculators", hidden_size=256,
               dtype=torch.float32)
    config, tensors = read_head(folder)
    rows, targets = [], []
    for ids in sequences:
        with torch.no_grad():
            states = tiny4[1](torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in LAYER_IDS], dim=-1)[:-1]
        embeds = tensors["embed_tokens.weight"][torch.tensor(ids[1:])]
        prenorm = reference_forward(config, tensors, aux, embeds)
        normed = prenorm * torch.rsqrt(prenorm.pow(2).mean(-1, keepdim=True) + 1e-5) \
            * tensors["norm.weight"]
        rows.append(normed[:-1])
        targets += [vocab.index(t) for t in ids[2:]]
    features = torch.cat(rows).double()
    one_hot = torch.nn.functional.one_hot(torch.tensor(targets), len(vocab)).double()
    lm_head = torch.linalg.lstsq(features, one_hot).solution.T.float()
    d2t = tensors["d2t"]
    if scrambled:
        ids = torch.tensor(vocab)[torch.randperm(len(vocab),
                                                 generator=torch.Generator().manual_seed(3))]
        d2t = ids - torch.arange(len(vocab))
    from safetensors.torch import load_file, save_file

    raw = load_file(str(folder / "model.safetensors"))
    raw["lm_head.weight"], raw["d2t"] = lm_head.contiguous(), d2t.contiguous()
    save_file(raw, str(folder / "model.safetensors"))
    return folder


def test_a_fitted_head_is_accepted_often_and_a_scrambled_d2t_rarely(tiny4, plain_outputs,
                                                                     tmp_path):
    rates = {}
    for scrambled in (False, True):
        folder = _fitted_head(tmp_path / f"s{scrambled}", tiny4, plain_outputs, scrambled)
        llm = make_llm(str(tiny4[0]), speculative_method="eagle", draft_head=str(folder),
                       adaptive=False, num_speculative_tokens=2, eagle_ngram_min=0)
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == [out for _, out in plain_outputs]
        stats = [o.spec_stats for o in outputs]
        rates[scrambled] = (sum(s.num_accepted_tokens for s in stats)
                            / sum(s.num_draft_tokens for s in stats))
    assert rates[False] > 0.4 and rates[True] < 0.1, rates


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory, default_model_folder):
    from tests.engine.test_spec_decode_engine import VOCAB

    folder = tmp_path_factory.mktemp("target-v6-4layers")
    hf = make_tiny_model(folder, vocab_size=VOCAB, tokenizer_from=default_model_folder,
                         num_hidden_layers=4)
    return folder, hf


@pytest.mark.parametrize("variant", ["eagle3", "speculators"])
def test_sampled_speculation_with_a_published_head_matches_the_target_distribution(
        variant, small_vocab_target, tmp_path, monkeypatch):
    """The chi-square law of tests/engine/test_spec_decode_engine.py, with a published head whose
    draft vocabulary is 5 of the 6 tokens (q is zero on the sixth): its negative control, a
    verifier that accepts every draft, is rejected."""
    from tests.engine.test_spec_decode_engine import (NUM_SAMPLES, _broken_verify,
                                                      _chi_square_rejects, _exact_joint,
                                                      _sample_first_three)

    folder, hf = small_vocab_target
    head = write_head(tmp_path / "head", hf.config, [0, 1, 2, 4, 5], LAYER_IDS,
                      **VARIANTS[variant])
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    expected = _exact_joint(hf, params)
    llm = make_llm(str(folder), speculative_method="eagle", draft_head=str(head), adaptive=False,
                   num_speculative_tokens=3, max_num_seqs=512, max_num_batched_tokens=8192,
                   enable_prefix_caching=False, eagle_ngram_min=0)
    samples = _sample_first_three(llm, params)
    spec_stats = llm.engine.scheduler.spec_stats
    assert spec_stats.num_draft_tokens >= 1.5 * NUM_SAMPLES
    assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    assert not _chi_square_rejects(samples, expected)
    monkeypatch.setattr("engine.sample.verifier.verify", _broken_verify)
    assert _chi_square_rejects(_sample_first_three(llm, params), expected)


def test_beside_an_integer_target_a_published_head_is_lossless(default_model_folder, tmp_path):
    """The default model on the integer kernels (--quantization gguf): the head's projections
    become Q8_0 blocks too, and greedy output stays `none`'s."""
    from transformers import AutoConfig

    from engine.models.layers import Linear

    config = AutoConfig.from_pretrained(default_model_folder)
    folder = write_head(tmp_path / "head", config, _draft_vocab(2048), [2, 15, 27], std=0.05)
    plain = make_llm(speculative_method="none", quantization="gguf")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = make_llm(speculative_method="eagle", draft_head=str(folder), quantization="gguf",
                   adaptive=False, num_speculative_tokens=3, eagle_ngram_min=0)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    head = llm.engine.proposer.head
    assert all(m.gguf is not None for m in head.modules() if isinstance(m, Linear))
