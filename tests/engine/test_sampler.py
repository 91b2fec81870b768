"""Tests of engine.sampler on forged logits (no model): exact filter cases, greedy rows, logit
bias, seeded determinism and logprobs. Penalties and the token histories they read:
test_sampler_penalties.py. Sampling's convergence to the target distribution:
test_sampler_distribution.py."""

from __future__ import annotations

import pytest
import torch

from engine.sample.sampler import (
    apply_top_k_top_p_min_p,
    sample,
    seeded_generator,
    target_probs,
)
from engine.sampling_params import SamplingParams
from tests.engine.sampler_helpers import device, make_batch, rng  # noqa: F401  (device: autouse)

FORGED_PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def forged_logits() -> torch.Tensor:  # [1, 4]
    return torch.tensor([FORGED_PROBS]).log()


# ------------------------------------------------------------------------------------ greedy
def test_all_greedy_is_argmax():
    logits = torch.randn(5, 40, generator=rng(0))
    out = sample(logits, make_batch([SamplingParams(temperature=0)] * 5, 40))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_rows_mixed_with_sampled_rows_are_argmax(seed):
    logits = torch.randn(4, 40, generator=rng(seed))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=10),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=seed)]
    batch = make_batch(params, 40, generator=rng(seed))
    assert batch.any_greedy and not batch.all_greedy
    token_ids = sample(logits, batch).token_ids
    assert token_ids[0] == logits[0].argmax() and token_ids[2] == logits[2].argmax()


# ----------------------------------------------------------------------------------- filters
def test_top_k_keeps_exactly_the_k_best_per_row():
    logits = torch.randn(3, 50, generator=rng(1))
    batch = make_batch([SamplingParams(top_k=5), SamplingParams(top_k=1),
                        SamplingParams(top_k=17)], 50)
    masked = apply_top_k_top_p_min_p(logits, batch)
    for row, k in enumerate([5, 1, 17]):
        assert kept(masked[row]) == set(logits[row].topk(k).indices.tolist())
        finite = torch.isfinite(masked[row])
        assert torch.equal(masked[row][finite], logits[row][finite])  # survivors unchanged


@pytest.mark.parametrize("top_p, num_kept", [(0.3, 1), (0.5, 1), (0.8, 2), (0.81, 3), (0.99, 4)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, num_kept):
    masked = apply_top_k_top_p_min_p(forged_logits(), make_batch([SamplingParams(top_p=top_p)], 4))
    assert kept(masked[0]) == set(range(num_kept))


def test_top_p_applies_after_top_k_renormalization():
    # top_k=3 renormalizes [0.5, 0.3, 0.15] to [0.526, 0.316, 0.158]: two tokens already hold
    # 0.842 >= 0.84, where the unrenormalized 0.8 would have needed a third.
    batch = make_batch([SamplingParams(top_k=3, top_p=0.84)], 4)
    assert kept(apply_top_k_top_p_min_p(forged_logits(), batch)[0]) == {0, 1}


@pytest.mark.parametrize("min_p, num_kept", [(0.05, 4), (0.2, 3), (0.31, 2), (0.7, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_max_prob(min_p, num_kept):
    masked = apply_top_k_top_p_min_p(forged_logits(), make_batch([SamplingParams(min_p=min_p)], 4))
    assert kept(masked[0]) == set(range(num_kept))


def test_top_token_always_survives():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3)
    batch = make_batch([SamplingParams(top_p=1e-6), SamplingParams(top_k=1),
                        SamplingParams(min_p=1.0)], 4)
    for row in apply_top_k_top_p_min_p(logits, batch):
        assert kept(row) == {2}


def test_disabled_filters_change_nothing_even_beside_filtered_rows():
    # One dominant token over a long tail: the float32 cumsum reaches 1.0 long before the tail
    # ends, which once masked the tail of rows whose top_p was disabled.
    logits = torch.randn(3, 20_000, generator=rng(2)) * 3
    logits[:, 7] = 25.0
    params = [SamplingParams(), SamplingParams(top_k=20_000, top_p=1.0, min_p=0.0),
              SamplingParams(top_k=5, top_p=0.5, min_p=0.1)]
    masked = apply_top_k_top_p_min_p(logits, make_batch(params, 20_000))
    assert torch.equal(masked[:2], logits[:2])
    assert kept(masked[2]) == {7}
    alone = make_batch([SamplingParams()], 20_000)
    assert not (alone.use_top_k or alone.use_top_p or alone.use_min_p)
    assert torch.equal(apply_top_k_top_p_min_p(logits[:1], alone), logits[:1])


def test_build_sampling_batch_normalizes_disabled_settings():
    batch = make_batch([SamplingParams(top_k=0, logprobs=2), SamplingParams(top_k=-1),
                        SamplingParams(top_k=99, logprobs=5), SamplingParams(top_k=3)], 10)
    assert batch.top_k.tolist() == [10, 10, 10, 3]
    assert batch.use_top_k and not batch.use_top_p and not batch.use_min_p
    assert batch.max_num_logprobs == 5 and batch.penalties is None and batch.logit_bias is None


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 2.5])
def test_temperature_scales_distribution(temperature):
    logits = torch.randn(2, 30, generator=rng(3))
    batch = make_batch([SamplingParams(temperature=temperature)] * 2, 30)
    expected = (logits / temperature).softmax(dim=-1)
    torch.testing.assert_close(target_probs(logits, batch), expected)


def test_target_probs_zero_outside_filters_and_renormalized():
    batch = make_batch([SamplingParams(top_p=0.8)], 4)
    torch.testing.assert_close(target_probs(forged_logits(), batch),
                               torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))


def test_logit_bias_adds_to_its_own_row_and_token():
    logits = torch.zeros(2, 5)
    logits[:, 0] = 1.0
    params = [SamplingParams(temperature=0, logit_bias={3: 1.5}),
              SamplingParams(temperature=0, logit_bias={0: -2.0, 4: 0.5})]
    batch = make_batch(params, 5)
    assert batch.logit_bias.rows.tolist() == [0, 1, 1]
    assert batch.logit_bias.token_ids.tolist() == [3, 0, 4]
    assert sample(logits, batch).token_ids.tolist() == [3, 4]


def test_logit_bias_equals_sampling_from_biased_logits():
    logits = torch.randn(3, 20, generator=rng(4))
    bias = {2: 3.0, 11: -1.0}
    params = [SamplingParams(seed=s, logit_bias=bias if s == 1 else None) for s in range(3)]
    biased = logits.clone()
    biased[1, 2] += 3.0
    biased[1, 11] -= 1.0
    for position in range(20):
        outputs = [[0] * position] * 3
        with_bias = sample(logits, make_batch(params, 20, outputs=outputs)).token_ids
        plain = [SamplingParams(seed=s) for s in range(3)]
        assert torch.equal(with_bias, sample(biased, make_batch(plain, 20, outputs=outputs)).token_ids)


# ---------------------------------------------------------------------------- seeded sampling
def test_seeded_generator_depends_only_on_seed_and_position():
    device = torch.get_default_device()
    draw = lambda seed, pos: torch.rand(8, generator=seeded_generator(seed, pos, device))  # noqa: E731
    assert torch.equal(draw(7, 3), draw(7, 3))
    assert not torch.equal(draw(7, 3), draw(7, 4))
    assert not torch.equal(draw(7, 3), draw(8, 3))


def test_seeded_rows_ignore_other_rows_and_row_order():
    vocab = 1000
    logits_a, logits_b = torch.randn(2, vocab, generator=rng(5))
    a, b = SamplingParams(seed=42, top_p=0.95), SamplingParams(seed=7)
    out_a, out_b = [5, 6, 7], [1]
    alone = sample(logits_a[None], make_batch([a], vocab, outputs=[out_a])).token_ids[0]
    noisy = torch.randn(3, vocab)
    mixed_logits = torch.stack([noisy[0], logits_b, noisy[1], logits_a, noisy[2]])
    mixed_params = [SamplingParams(temperature=0.8), b, SamplingParams(temperature=0), a,
                    SamplingParams(top_k=3)]
    mixed = sample(mixed_logits, make_batch(mixed_params, vocab,
                                            outputs=[[], out_b, [9], out_a, []],
                                            generator=rng(99))).token_ids
    swapped = sample(torch.stack([logits_a, logits_b]),
                     make_batch([a, b], vocab, outputs=[out_a, out_b])).token_ids
    assert mixed[3] == alone == swapped[0]
    assert mixed[1] == swapped[1]


def test_seeded_tokens_differ_across_positions_and_seeds():
    vocab = 1000
    logits = torch.zeros(1, vocab)  # uniform: any two draws collide with probability 1/1000

    def token(seed, position):
        batch = make_batch([SamplingParams(seed=seed)], vocab, outputs=[[0] * position])
        return sample(logits, batch).token_ids.item()

    by_position = [token(1, pos) for pos in range(20)]
    by_seed = [token(seed, 0) for seed in range(20)]
    assert len(set(by_position)) >= 15 and len(set(by_seed)) >= 15
    assert by_position == [token(1, pos) for pos in range(20)]


# --------------------------------------------------------------------------------- logprobs
def test_logprobs_are_those_of_raw_logits():
    logits = torch.randn(3, 30, generator=rng(6))
    params = [SamplingParams(logprobs=4, temperature=0.5, logit_bias={1: 2.0}),
              SamplingParams(logprobs=2, temperature=0, presence_penalty=1.0),
              SamplingParams(logprobs=None, seed=3)]
    out = sample(logits, make_batch(params, 30, outputs=[[1], [2, 2], []]))
    expected = logits.log_softmax(dim=-1)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    sorted_values, sorted_ids = expected.sort(dim=-1, descending=True)
    assert out.top_logprobs.shape == (3, 4) and out.top_token_ids.shape == (3, 4)
    torch.testing.assert_close(out.top_logprobs, sorted_values[:, :4])
    assert torch.equal(out.top_token_ids, sorted_ids[:, :4])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_logprobs_zero_gives_chosen_only_and_none_gives_nothing():
    logits = torch.randn(2, 10, generator=rng(7))
    zero = sample(logits, make_batch([SamplingParams(temperature=0, logprobs=0)] * 2, 10))
    assert zero.logprobs is not None and zero.top_logprobs is None and zero.top_token_ids is None
    none = sample(logits, make_batch([SamplingParams(temperature=0)] * 2, 10))
    assert none.logprobs is None and none.top_logprobs is None and none.top_token_ids is None
    assert torch.equal(zero.token_ids, none.token_ids)


def test_host_copies_take_tensors_already_on_the_device(device):
    """Under this file's `with torch.device(...)`, the sampler's "host" tensors are made on the
    device itself; copying them must not try to pin them (only host memory pins). The meta
    device stands in for an accelerator on a CPU-only machine."""
    from engine.core.device import copy_to_device, to_device

    target = torch.device("meta") if device.type == "cpu" else device
    with torch.device(target):
        made_there = [torch.tensor([1, 2, 3]), torch.tensor([[4], [5]])]
    moved = copy_to_device(made_there, target)
    assert [t.shape for t in moved] == [(3,), (2, 1)] and moved[0].device.type == target.type
    assert to_device(made_there[0], target).device.type == target.type
