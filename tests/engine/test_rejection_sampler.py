"""Tests of engine.sample.rejection_sampler on forged distributions (no model): exact
acceptance cases, the residual and bonus distributions, the expected tokens per step for a known
acceptance rate, and convergence of the first emitted token to the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.rejection_sampler import (
    accept_drafts,
    next_token_probs,
    rejection_sample,
)

CHI2_CRITICAL_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001
FORGED_TARGET = [0.35, 0.25, 0.2, 0.15, 0.05]
FORGED_DRAFT = [0.1, 0.15, 0.2, 0.25, 0.3]


def accepted(target_probs, draft_token_ids, num_drafts, draft_probs=None, uniforms=None,
             greedy=None):
    num_seqs, max_k = len(draft_token_ids), len(draft_token_ids[0])
    target = torch.tensor(target_probs)  # [num_seqs, max_k + 1, vocab]
    return accept_drafts(
        target_probs=target,
        draft_token_ids=torch.tensor(draft_token_ids, dtype=torch.long).view(num_seqs, max_k),
        num_drafts=torch.tensor(num_drafts),
        draft_probs=None if draft_probs is None else torch.tensor(draft_probs),
        uniforms=torch.zeros(num_seqs, max_k) if uniforms is None else torch.tensor(uniforms),
        greedy=torch.zeros(num_seqs, dtype=torch.bool) if greedy is None else torch.tensor(greedy),
        target_argmax=target.argmax(dim=-1),
    ).tolist()


def test_certain_target_token_is_always_accepted():
    target = [[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]]
    almost_one = [[0.9999, 0.9999]]
    assert accepted(target, [[1, 2]], [2], uniforms=almost_one) == [2]
    draft = [[[0.2, 0.7, 0.1], [0.1, 0.1, 0.8]]]
    assert accepted(target, [[1, 2]], [2], draft_probs=draft, uniforms=almost_one) == [2]


def test_impossible_target_token_is_always_rejected():
    target = [[[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]]]
    assert accepted(target, [[1]], [1]) == [0]  # uniform 0: 0 * q < 0 is false
    assert accepted(target, [[1]], [1], draft_probs=[[[0.0, 1.0, 0.0]]]) == [0]


def test_acceptance_boundary_is_u_times_q_below_p():
    # p(d) = 0.3, q(d) = 0.6: accept with probability 0.5, i.e. iff u < 0.5.
    target = [[[0.3, 0.7], [0.5, 0.5]]] * 4
    draft = [[[0.6, 0.4]]] * 4
    uniforms = [[0.0], [0.49], [0.51], [0.99]]
    result = accepted(target, [[0]] * 4, [1] * 4, draft_probs=draft, uniforms=uniforms)
    assert result == [1, 1, 0, 0]
    # One-hot draft (q(d) = 1): accept iff u < p(d) = 0.3.
    uniforms = [[0.0], [0.29], [0.31], [0.99]]
    assert accepted(target, [[0]] * 4, [1] * 4, uniforms=uniforms) == [1, 1, 0, 0]


def test_a_rejection_stops_acceptance_of_later_drafts():
    certain, impossible = [1.0, 0.0], [0.0, 1.0]
    target = [[certain, impossible, certain, certain]]
    assert accepted(target, [[0, 0, 0]], [3]) == [1]
    target = [[impossible, certain, certain, certain]]
    assert accepted(target, [[0, 0, 0]], [3]) == [0]


def test_padding_beyond_num_drafts_is_never_accepted():
    certain = [1.0, 0.0]
    target = [[certain] * 4] * 3
    assert accepted(target, [[0, 0, 0]] * 3, [0, 1, 2]) == [0, 1, 2]
    greedy = [True] * 3
    assert accepted(target, [[0, 0, 0]] * 3, [0, 1, 2], greedy=greedy) == [0, 1, 2]


def test_no_drafts_gives_the_target_distribution():
    target = torch.tensor([[[0.2, 0.8]], [[0.6, 0.4]]])  # [2, 1, 2]
    out = rejection_sample(target, torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]),
                           None, torch.zeros(2, 0), torch.tensor([False, False]),
                           target.argmax(dim=-1))
    assert out.num_accepted.tolist() == [0, 0]
    torch.testing.assert_close(out.next_token_probs, target[:, 0])


def test_greedy_rows_accept_while_the_draft_is_the_target_argmax():
    # Argmax per position: 2, 0, 1, 1. Uniforms of 0.9999 would reject every sampled draft.
    target = [[[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.1, 0.8, 0.1]]]
    uniforms = [[0.9999] * 3]
    assert accepted(target, [[2, 0, 1]], [3], uniforms=uniforms, greedy=[True]) == [3]
    assert accepted(target, [[2, 0, 0]], [3], uniforms=uniforms, greedy=[True]) == [2]
    assert accepted(target, [[0, 0, 1]], [3], uniforms=uniforms, greedy=[True]) == [0]
    assert accepted(target, [[2, 0, 1]], [3], uniforms=uniforms, greedy=[False]) == [0]


def test_mixed_batch_of_greedy_and_sampled_rows_with_different_num_drafts():
    row = [[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.1, 0.8, 0.1]]
    drafts = [[2, 0, 1], [2, 1, 0], [2, 0, 1], [2, 0, 1], [0, 0, 0]]
    num_drafts = [3, 3, 2, 3, 0]
    greedy = [True, True, True, False, False]
    # Sampled row 3: p(d) = 0.7, 0.5, 0.4 against u = 0.6, 0.4, 0.5.
    uniforms = [[0.0] * 3] * 3 + [[0.6, 0.4, 0.5], [0.0] * 3]
    result = accepted([row] * 5, drafts, num_drafts, uniforms=uniforms, greedy=greedy)
    assert result == [3, 1, 2, 2, 0]


def test_residual_at_a_rejection_is_normalized_positive_part_of_target_minus_draft():
    target = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25] * 4]])
    draft = torch.tensor([[[0.4, 0.1, 0.1, 0.4]]])
    probs = next_token_probs(target, torch.tensor([[0]]), torch.tensor([1]), draft,
                             torch.tensor([0]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1 / 3, 2 / 3, 0.0]]))


def test_one_hot_draft_residual_zeroes_the_draft_token():
    target = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.25] * 4]])
    probs = next_token_probs(target, torch.tensor([[0, 3]]), torch.tensor([2]), None,
                             torch.tensor([1]))
    torch.testing.assert_close(probs, torch.tensor([[1 / 6, 2 / 6, 3 / 6, 0.0]]))


def test_bonus_is_the_target_distribution_after_the_last_draft():
    target = torch.tensor([
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]],
        [[1.0, 0.0, 0.0], [0.6, 0.3, 0.1], [0.0, 0.0, 1.0]],  # one draft of two slots
    ])
    out = rejection_sample(target, torch.tensor([[0, 1], [0, 2]]), torch.tensor([2, 1]),
                           None, torch.full((2, 2), 0.5), torch.tensor([False, False]),
                           target.argmax(dim=-1))
    assert out.num_accepted.tolist() == [2, 1]
    torch.testing.assert_close(out.next_token_probs, torch.stack([target[0, 2], target[1, 1]]))


def test_greedy_row_with_sampled_drafts_recovers_the_target_argmax():
    # The residual max(0, p - q) = [0.05, 0.4, 0] peaks at 1; greedy must still give argmax p = 0.
    target = torch.tensor([[[0.5, 0.4, 0.1], [0.2, 0.3, 0.5]]])
    draft = torch.tensor([[[0.45, 0.0, 0.55]]])
    out = rejection_sample(target, torch.tensor([[2]]), torch.tensor([1]), draft,
                           torch.zeros(1, 1), torch.tensor([True]), target.argmax(dim=-1))
    assert out.num_accepted.tolist() == [0]
    assert out.next_token_probs.argmax(dim=-1).tolist() == [0]


@pytest.mark.parametrize("alpha, k, one_hot", [(0.8, 4, True), (0.5, 3, False), (0.9, 6, False)])
def test_tokens_per_step_match_the_geometric_expectation(alpha, k, one_hot):
    num_seqs = 40_000
    generator = torch.Generator().manual_seed(1234)
    # Draft token 0 everywhere; p(0) / q(0) = alpha, so each draft is accepted w.p. alpha.
    draft_q = 1.0 if one_hot else 0.5
    target_row = torch.tensor([alpha * draft_q, 1 - alpha * draft_q])
    target = target_row.expand(num_seqs, k + 1, 2)
    draft = None if one_hot else torch.tensor([draft_q, 1 - draft_q]).expand(num_seqs, k, 2)
    out = rejection_sample(target, torch.zeros(num_seqs, k, dtype=torch.long),
                           torch.full((num_seqs,), k), draft,
                           torch.rand(num_seqs, k, generator=generator),
                           torch.zeros(num_seqs, dtype=torch.bool), target.argmax(dim=-1))
    emitted = (out.num_accepted + 1).double()
    # Exact law: P(num_accepted = j) = alpha^j (1 - alpha) for j < k, alpha^k for j = k.
    law = [alpha ** j * (1 - alpha) for j in range(k)] + [alpha ** k]
    mean = sum((j + 1) * w for j, w in enumerate(law))
    variance = sum((j + 1 - mean) ** 2 * w for j, w in enumerate(law))
    assert mean == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert abs(emitted.mean().item() - mean) < 4.5 * math.sqrt(variance / num_seqs)


def first_emitted_tokens(uniforms_fn, num_trials=50_000, seed=0) -> torch.Tensor:
    """Draws d ~ draft, verifies it against the target and returns the first token emitted."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.tensor(FORGED_TARGET).expand(num_trials, 2, 5)
    draft = torch.tensor(FORGED_DRAFT).expand(num_trials, 1, 5)
    drafts = torch.multinomial(draft[:, 0], 1, replacement=True, generator=generator)
    out = rejection_sample(target, drafts, torch.ones(num_trials, dtype=torch.long), draft,
                           uniforms_fn(num_trials, generator), torch.zeros(num_trials, dtype=bool),
                           target.argmax(dim=-1))
    recovered = torch.multinomial(out.next_token_probs, 1, generator=generator).squeeze(1)
    return torch.where(out.num_accepted > 0, drafts.squeeze(1), recovered)


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.double) * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_first_emitted_token_follows_the_target_distribution():
    tokens = first_emitted_tokens(lambda n, g: torch.rand(n, 1, generator=g))
    assert chi_square(tokens, FORGED_TARGET) < CHI2_CRITICAL_DF4_P001


def test_always_accepting_follows_the_draft_and_fails_the_same_test():
    tokens = first_emitted_tokens(lambda n, g: torch.zeros(n, 1))  # u = 0: every draft accepted
    assert chi_square(tokens, FORGED_TARGET) > CHI2_CRITICAL_DF4_P001
    assert chi_square(tokens, FORGED_DRAFT) < CHI2_CRITICAL_DF4_P001
