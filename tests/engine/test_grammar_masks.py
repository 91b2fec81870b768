"""The grammar's token masks on logits (engine/grammar/masks.py): applied in place or into a new
tensor, on the compiled CPU pass and on the torch path, and the rows a mask alone decides."""

from __future__ import annotations

import pytest
import torch

from engine.grammar.masks import unpack_bitmask


@pytest.mark.parametrize("made_in", ["plain", "inference-mode"])
def test_masks_in_place_on_the_torch_path_equal_a_new_tensor(made_in):
    """Where the compiled pass does not apply (other devices and dtypes: float64 here), masks
    in place give what a new masked tensor gives, in the same tensor, also where the logits
    are inference tensors, as the model's are (a GPU's step failed on them); the control: the
    raw logits differ from it."""
    from engine.grammar.masks import apply_allowed, mask_logits

    with torch.inference_mode(made_in == "inference-mode"):
        logits = torch.randn(3, 70, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(1))
    assert logits.is_inference() == (made_in == "inference-mode")
    bitmask = torch.randint(-2**31, 2**31, (3, 3), dtype=torch.int32)
    expected = apply_allowed(logits, unpack_bitmask(bitmask, 70, torch.device("cpu")))
    raw = logits.clone()
    assert mask_logits(logits, bitmask, in_place=True) is logits and torch.equal(logits, expected)
    assert not torch.equal(raw, expected)


def test_known_next_tokens_reads_one_bit_rows_of_requests_without_logprobs():
    from types import SimpleNamespace

    from engine.grammar.masks import known_next_tokens

    bitmask = torch.full((5, 3), -1, dtype=torch.int32)
    bitmask[0] = torch.tensor([0, 1 << 5, 0])  # token 37
    bitmask[1] = torch.tensor([0, 0, -(1 << 31)])  # the sign bit: token 95
    bitmask[2] = torch.tensor([0b11, 0, 0])  # two tokens: not decided
    bitmask[3] = torch.tensor([1 << 4, 0, 0])  # token 4, but its request wants logprobs

    def request(drafts, logprobs=None):
        return SimpleNamespace(grammar=object(), draft_token_ids=drafts,
                               sampling_params=SimpleNamespace(logprobs=logprobs))

    requests = [request([7, 8]), request([], logprobs=1), request([])]
    assert known_next_tokens(requests, [0, 3, 4], bitmask) == {0: 37, 1: 95}
    assert known_next_tokens(requests, [0, 3, 4], None) == {}


def test_single_token_rows_compiled_and_in_torch_agree(monkeypatch):
    """The compiled reading of one-token rows and its torch fallback, on random rows, rows with
    one bit anywhere (the sign bit too) and rows with two bits in different words."""
    import engine.grammar.masks as masks

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31, (40, 5), dtype=torch.int32, generator=generator)
    for row in range(32):
        bitmask[row] = 0
        bitmask[row, row % 5] = -(1 << 31) if row % 7 == 0 else 1 << (row % 31)
    bitmask[30, 4] = 1  # two bits, two words
    bitmask[31] = 0  # nothing allowed
    compiled = masks.single_token_rows(bitmask)
    monkeypatch.setattr(masks, "cpu_ops_on", lambda device, dtype: None)
    assert torch.equal(masks.single_token_rows(bitmask), compiled)
    expected = [row % 5 * 32 + (31 if row % 7 == 0 else row % 31) for row in range(30)]
    assert compiled.tolist() == expected + [-1] * 10
