"""engine.sampler's draws against the distributions they must follow: chi-square tests with a
negative control, filters applied before sampling, masked tokens never drawn. Forged logits, no
model."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.sampler import sample, sample_from_probs
from engine.sampling_params import SamplingParams
from tests.engine.test_sampler import FORGED_PROBS, forged_logits, make_batch

CHI2_CRITICAL_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(samples: torch.Tensor, target_probs_: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=len(target_probs_)).double()
    expected = target_probs_.double() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


TARGET = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
NUM_DRAWS = 20_000


def draw_many(probs: torch.Tensor, seed: int) -> torch.Tensor:  # [NUM_DRAWS]
    generator = torch.Generator().manual_seed(seed)
    return sample_from_probs(probs.expand(NUM_DRAWS, -1).clone(), [generator] * NUM_DRAWS)


def test_sample_from_probs_matches_distribution():
    statistic = chi_square(draw_many(TARGET, seed=0), TARGET)
    assert statistic < CHI2_CRITICAL_DF5_P001


def test_chi_square_rejects_slightly_wrong_distribution():
    # Negative control: moving 1.5% of the mass from token 0 to token 5 must be detected.
    perturbed = TARGET + torch.tensor([-0.015, 0, 0, 0, 0, 0.015])
    statistic = chi_square(draw_many(perturbed, seed=0), TARGET)
    assert statistic > CHI2_CRITICAL_DF5_P001


def test_sample_matches_filtered_target_distribution():
    # top_p=0.7 on the forged distribution leaves [0.625, 0.375]; temperature 2 is applied first.
    logits = forged_logits() * 2.0
    batch = make_batch([SamplingParams(temperature=2.0, top_p=0.7)] * NUM_DRAWS, 4,
                       generator=torch.Generator().manual_seed(1))
    token_ids = sample(logits.expand(NUM_DRAWS, -1), batch).token_ids
    observed = torch.bincount(token_ids, minlength=4).double() / NUM_DRAWS
    assert observed[2:].sum() == 0
    assert math.isclose(observed[0], 0.625, abs_tol=0.015)


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.6), {0, 1}),
    (SamplingParams(min_p=0.2), {0, 1, 2}),
    (SamplingParams(temperature=5.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=5.0, min_p=0.5), {0, 1, 2, 3}),  # min-p after temperature
])
def test_sampling_never_draws_a_masked_token(params, allowed):
    # probs ~ [0.481, 0.288, 0.144, 0.048, 0.0096 x 4]
    logits = torch.tensor([FORGED_PROBS + [0.01] * 4]).log()
    num_rows = 5000
    batch = make_batch([params] * num_rows, 8, generator=torch.Generator().manual_seed(2))
    drawn = set(sample(logits.expand(num_rows, -1), batch).token_ids.tolist())
    assert drawn == allowed  # never outside, and every allowed token does come up


def test_inverse_cdf_draws_respect_zeros_and_tiny_tails():
    """u anywhere in [0, 1], even at 1 itself, lands on a token of positive probability, never
    on a zero after it (control: the unclamped search runs past the last token); and a tail of
    1,000 tokens at 1e-9 each keeps its mass: u = 1 - 5e-7 lands on the 500th tail token, as
    the exact inverse CDF does (float32 sums, which stop growing by 1e-9 near 1, miss it)."""
    from engine.sample.sampler import draw_tokens

    halves = torch.tensor([[0.5, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.4999, 0.5, 1 - 2 ** -53, 1.0], dtype=torch.float64)
    assert draw_tokens(halves, u).tolist() == [0, 0, 1, 1, 1]
    cdf = halves[-1:].double().cumsum(dim=-1)
    assert int(torch.searchsorted(cdf, cdf[:, -1:], right=True)) == 3
    tail = torch.cat([torch.tensor([1.0]), torch.full((1000,), 1e-9)]).unsqueeze(0)
    drawn = int(draw_tokens(tail, torch.tensor([1 - 5e-7], dtype=torch.float64)))
    assert 499 <= drawn <= 501
