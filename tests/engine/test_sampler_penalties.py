"""Tests of engine.sampler's repetition, frequency and presence penalties on forged logits, and of
the token histories (TokenHistory views) they count."""

from __future__ import annotations

import torch

from engine.sample.sampler import TokenHistory, apply_penalties, build_sampling_batch, sample
from engine.sampling_params import SamplingParams
from tests.engine.sampler_helpers import device, make_batch  # noqa: F401  (device: autouse)


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]] * 4)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5),
              SamplingParams(presence_penalty=0.25), SamplingParams()]
    prompts = [[0, 1]] * 4
    outputs = [[2, 3, 2]] * 4
    batch = make_batch(params, 6, prompts, outputs)
    penalized = apply_penalties(logits, batch.penalties)
    expected = torch.tensor([
        [1.0, -4.0, 0.5, -2.0, 0.5, 3.0],  # prompt and output tokens: /2 if > 0, *2 if < 0
        [2.0, -2.0, 0.0, -1.5, 0.5, 3.0],  # output tokens only, times their count
        [2.0, -2.0, 0.75, -1.25, 0.5, 3.0],  # output tokens only, once
        [2.0, -2.0, 1.0, -1.0, 0.5, 3.0],  # no penalties: untouched
    ])
    torch.testing.assert_close(penalized, expected)


def test_penalties_combine_and_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.5)]
    batch = make_batch(params, 4, [[3]], [[0, 0]])
    # token 0: 3 / 1.5 - 0.5 * 2 - 0.5 = 0.5; token 3 (prompt): -1 * 1.5 = -1.5
    torch.testing.assert_close(apply_penalties(logits, batch.penalties),
                               torch.tensor([[0.5, 2.9, 0.0, -1.5]]))
    assert sample(logits, batch).token_ids.tolist() == [1]


def test_token_history_views_build_the_batch_the_copied_histories_build(device):
    """Verified rows read their history through TokenHistory (output + the first j drafts, no
    copy): penalties and seeded generators equal those of copied lists; a view one draft short
    (the negative control) gives other penalty counts."""
    params = [SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.2)] * 3
    output, drafts = [5, 9, 5, 2], [9, 9, 7]
    prompts = [[1, 2, 5]] * 3
    copied = [output + drafts[:j] for j in range(3)]
    views = [TokenHistory(output, drafts, j) for j in range(3)]
    short = [TokenHistory(output, drafts, max(j - 1, 0)) for j in range(3)]

    def build(histories):
        return build_sampling_batch(params, prompts, histories, 16, device)

    expected, got, wrong = build(copied), build(views), build(short)
    assert torch.equal(got.penalties.output_counts, expected.penalties.output_counts)
    assert torch.equal(got.penalties.seen_mask, expected.penalties.seen_mask)
    assert [g.initial_seed() for g in got.generators] == \
        [g.initial_seed() for g in expected.generators]
    assert not torch.equal(wrong.penalties.output_counts, expected.penalties.output_counts)
    assert list(views[2]) == copied[2] and len(views[2]) == 6 and views[2][-1] == 9
