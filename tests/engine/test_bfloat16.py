"""What "lossless" means in bfloat16, tested.

In float32 a speculative run gives exactly the tokens of a non-speculative one. In bfloat16 the
target scores K+1 verified positions with other kernels (other shapes, other summation orders)
than a one-token decode step, so the two can round a logit differently: where the top two tokens
are within bfloat16's rounding of each other, the argmax may differ. The promise is therefore
greedy agreement up to near-ties (a divergence only where the non-speculative run's top-2
log-probability margin is at most NEAR_TIE_NATS) and, for sampling, the target's distribution
(the bfloat16 chi-square case in test_spec_decode_engine.py).
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import TEST_DEVICE, make_llm
from tests.engine.test_spec_decode_engine import PROMPTS, _broken_verify

# Two bfloat16 steps (8 bits of mantissa) at logits of magnitude 8-16.
NEAR_TIE_NATS = 0.125
PARAMS = SamplingParams(max_tokens=32, temperature=0, logprobs=2, ignore_eos=True)


def _divergences_beyond_near_ties(plain, speculative) -> list[tuple[int, int, float]]:
    """(prompt, position, margin) of each first divergence that is not a near-tie."""
    bad = []
    for index, (a, b) in enumerate(zip(plain, speculative)):
        position = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t),
                        None)
        if position is not None:
            top = a.logprobs[position].top
            margin = top[0][1] - top[1][1]
            if margin > NEAR_TIE_NATS:
                bad.append((index, position, margin))
    return bad


def test_bfloat16_greedy_speculation_agrees_up_to_near_ties(tiny_chat_model_folder, monkeypatch):
    target = str(tiny_chat_model_folder)
    plain = make_llm(target, speculative_method="none", dtype="bfloat16").generate(PROMPTS, PARAMS)
    # Drafts from two of the target's three layers: right often enough to be accepted, wrong
    # often enough to be rejected.
    llm = make_llm(target, speculative_method="layer-skip", draft_layer_ids=(0, 2),
                   adaptive=False, num_speculative_tokens=4, dtype="bfloat16")
    speculative = llm.generate(PROMPTS, PARAMS)
    stats = [o.spec_stats for o in speculative]
    assert sum(s.num_draft_tokens for s in stats) > 100
    assert 0 < sum(s.num_accepted_tokens for s in stats) < sum(s.num_draft_tokens for s in stats)
    assert _divergences_beyond_near_ties(plain, speculative) == []
    # Negative control: a verifier that accepts every draft diverges where it is no tie.
    monkeypatch.setattr("engine.sample.verifier.verify", _broken_verify)
    assert _divergences_beyond_near_ties(plain, llm.generate(PROMPTS, PARAMS))


@pytest.mark.skipif(TEST_DEVICE.type != "cuda",
                    reason="the row-invariant kernels are GPU ones; a CPU agrees up to near-ties")
@pytest.mark.parametrize("method", ["layer-skip", "suffix"])
def test_bfloat16_greedy_speculation_is_exact_with_batch_invariance(tiny_chat_model_folder,
                                                                    monkeypatch, method):
    """With --batch-invariant a verified row rounds as a decoded one on a GPU
    (invariant_linear.py, the attention kernel's 16-row programs), so bfloat16 speculation gives
    `none`'s tokens exactly: layer-skip with 4 drafts for the prompts together (at most 35 rows
    a step); suffix with 15 (16-row queries, over several attention programs), each prompt
    alone, twice, so the second pass drafts from the first's answers."""
    target = str(tiny_chat_model_folder)
    plain = make_llm(target, speculative_method="none", dtype="bfloat16", batch_invariant=True)
    options = {"layer-skip": dict(draft_layer_ids=(0, 2), num_speculative_tokens=4),
               "suffix": dict(num_speculative_tokens=15)}[method]
    llm = make_llm(target, speculative_method=method, adaptive=False, dtype="bfloat16",
                   batch_invariant=True, **options)

    def run(engine):
        if method == "suffix":
            return [engine.generate(p, PARAMS)[0] for p in PROMPTS + PROMPTS]
        return engine.generate(PROMPTS, PARAMS)

    want = [o.token_ids for o in run(plain)]
    speculative = run(llm)
    stats = [o.spec_stats for o in speculative]
    assert sum(s.num_draft_tokens for s in stats) > 100
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert [o.token_ids for o in speculative] == want
    if method == "layer-skip":  # its drafts are often wrong (suffix's second pass's, not)
        # Negative control: a verifier that accepts every draft leaves the plain tokens.
        monkeypatch.setattr("engine.sample.verifier.verify", _broken_verify)
        assert [o.token_ids for o in run(llm)] != want
