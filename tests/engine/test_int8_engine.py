"""--quantization gguf (int8 activations, integer dot products) keeps speculation lossless: its
kernels are row invariant, so a verified position computes what a decode step computes there.
Greedy output with each proposer equals `none`'s, one prompt at a time, batched and under
preemption; seeded sampling gives the same tokens with and without speculation."""

from __future__ import annotations

import pytest

from specserve.bench.workloads import KINDS, encode, load_workloads
from engine import SamplingParams
from engine.quant.kernels import load_kernel
from tests.conftest import make_llm

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="the CPU kernels did not build")
GREEDY = SamplingParams(max_tokens=16, temperature=0)
SEEDED = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed)
          for seed in range(8)]


def integer_llm(**options):
    return make_llm(quantization="gguf", **options)


@pytest.fixture(scope="module")
def prompts():
    """120 prompts: the bundled code, copy and chat sets."""
    llm = integer_llm(speculative_method="none")
    return [encode(llm.tokenizer, w) for kind in KINDS for w in load_workloads(kind, 40)]


@pytest.fixture(scope="module")
def plain(prompts):
    llm = integer_llm(speculative_method="none")
    assert any(getattr(m, "gguf", None) is not None and "Q4_1x16" in m.gguf.format_names
               for m in llm.engine.runner.model.modules())
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "eagle"])
def test_greedy_speculation_on_the_integer_path_is_lossless(method, prompts, plain):
    options = {"draft_layer_ids": (0, 1, 14, 29)} if method == "layer-skip" else {}
    llm = integer_llm(speculative_method=method, adaptive=False, num_speculative_tokens=4,
                      **options)
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == plain
    stats = [o.spec_stats for o in batched]
    assert sum(s.num_draft_tokens for s in stats) > 100  # speculation really ran
    if method != "layer-skip":  # four of thirty layers rarely guess right; the others do
        assert sum(s.num_accepted_tokens for s in stats) > 50
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts[::15]]
    assert alone == plain[::15]


def test_greedy_speculation_on_the_integer_path_is_lossless_under_preemption(prompts, plain):
    llm = integer_llm(speculative_method="ngram", adaptive=False, num_speculative_tokens=4,
                      num_kv_blocks=24)
    outputs = llm.generate(prompts[:16], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == plain[:16]


def test_seeded_sampling_on_the_integer_path_is_unchanged_by_speculation(prompts):
    chosen = prompts[40:48]  # copy prompts: n-gram drafts get accepted
    outputs = {}
    for method in ("none", "ngram"):
        llm = integer_llm(speculative_method=method, adaptive=False, num_speculative_tokens=4)
        outputs[method] = [o.token_ids for o in llm.generate(chosen, SEEDED)]
    assert outputs["ngram"] == outputs["none"]


def test_the_integer_path_is_not_the_float_path(prompts, plain):
    """Negative control: the integer path computes something else than gguf-exact (so the
    equalities above are not the float path's), while mostly agreeing with it."""
    exact = make_llm(quantization="gguf-exact", speculative_method="none")
    exact_tokens = [o.token_ids for o in exact.generate(prompts, GREEDY)]
    assert exact_tokens != plain
    first_same = sum(a[0] == b[0] for a, b in zip(exact_tokens, plain))
    assert first_same >= 0.9 * len(plain)
