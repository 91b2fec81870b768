"""Temperatures and repetition penalties at the edges of float (1e-300, 1e300) sample from the law
they tend to, never from NaN noise (issue 29: `repetition_penalty: 1e-300` returned empty text).
Each test has a negative control: the same tensors without the hold give inf or NaN."""

from __future__ import annotations

import dataclasses

import torch

from engine.sample.sampler import apply_penalties, build_sampling_batch, sample, target_probs
from engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, -2.0, 1.0, 0.0, 0.5, 3.0, -0.5, 1.5]])
VOCAB = LOGITS.shape[1]


def _batch(params: SamplingParams, prompt=(), output=()):
    return build_sampling_batch([params], [list(prompt)], [list(output)], VOCAB,
                                torch.device("cpu"))


def test_a_vanishing_temperature_is_greedy():
    params = SamplingParams(temperature=1e-300, seed=7)
    assert params.greedy and params.temperature == 0
    assert sample(LOGITS, _batch(params)).token_ids.tolist() == [5]
    assert not SamplingParams(temperature=1e-4).greedy  # above the bound: still sampled
    # Negative control: float32 turns 1e-300 into 0, and logits / 0 are inf or NaN.
    assert not torch.isfinite(LOGITS / torch.tensor(1e-300, dtype=torch.float32)).any()


def test_a_huge_temperature_is_uniform_over_the_kept_tokens():
    params = SamplingParams(temperature=1e300, top_k=3, seed=1)
    probs = target_probs(LOGITS, _batch(params))[0]
    assert torch.isfinite(probs).all()
    top3 = {5, 0, 7}
    torch.testing.assert_close(probs[sorted(top3)], torch.full((3,), 1 / 3))
    assert probs.sum().item() == probs[sorted(top3)].sum().item()
    for seed in range(20):
        token = sample(LOGITS, _batch(dataclasses.replace(params, seed=seed))).token_ids.item()
        assert token in top3
    # Negative control: the raw temperature is inf in float32; every logit becomes 0, so top-k
    # keeps whichever three tokens sort first, not the three best.
    raw = _batch(params)
    raw.temperature = torch.tensor([float("inf")])
    assert set(target_probs(LOGITS, raw)[0].nonzero().flatten().tolist()) != top3


def test_a_vanishing_repetition_penalty_puts_the_mass_on_seen_tokens():
    seen = [2, 4]  # logits 1.0 and 0.5: the larger one wins over the unseen 3.0
    tiny = _batch(SamplingParams(temperature=0, repetition_penalty=1e-300), prompt=seen)
    penalized = apply_penalties(LOGITS, tiny.penalties)
    assert torch.isfinite(penalized).all()
    assert sample(LOGITS, tiny).token_ids.tolist() == [2]
    limit = _batch(SamplingParams(temperature=0, repetition_penalty=1e-30), prompt=seen)
    assert torch.equal(penalized, apply_penalties(LOGITS, limit.penalties))
    # Negative control: the raw penalty is 0 in float32: seen logits become inf and NaN.
    tiny.penalties.repetition = torch.zeros(1)
    raw = apply_penalties(LOGITS, tiny.penalties)
    assert torch.isinf(raw[0, 2]) and torch.isinf(raw[0, 4])


def test_a_huge_repetition_penalty_keeps_a_zero_logit_finite():
    seen = [3, 1]  # logits 0.0 and -2.0
    huge = _batch(SamplingParams(temperature=0.8, repetition_penalty=1e300, seed=3),
                  prompt=seen)
    penalized = apply_penalties(LOGITS, huge.penalties)
    assert torch.isfinite(penalized).all()
    assert penalized[0, 3] == 0 and penalized[0, 1] < -1e29
    assert torch.isfinite(target_probs(penalized, huge)).all()
    # Negative control: 0 * inf is NaN.
    huge.penalties.repetition = torch.tensor([float("inf")])
    assert torch.isnan(apply_penalties(LOGITS, huge.penalties)[0, 3])
