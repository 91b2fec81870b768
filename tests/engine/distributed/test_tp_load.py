"""Per-rank loading of a float checkpoint (engine/distributed/shard_load.py), in one process
with a stub group (no collective runs while loading): for every tiny family of
test_tp_logits.py, each rank's model read piece by piece holds bitwise the parameters that
cutting the fully loaded model gives (shard_model after load: the reference), and only its
share of the bytes. Negative controls: the other rank's piece, or a translation that ignores a
fused matrix's row offset, fail the comparison."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import shard, shard_load
from engine.distributed.group import ParallelGroup
from engine.distributed.shard_model import shard_model
from engine.models.loader import _load_float
from tests.conftest import make_tiny_model
from tests.engine.distributed.test_tp_logits import TP_FAMILIES, _exchanged

CPU = torch.device("cpu")
# Three ranks: 6 query heads over 3 KV heads, and a vocabulary of 254 (85, 85, 84 rows).
THREE_RANKS = ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                         "intermediate_size": 96, "vocab_size": 254, "attention_bias": True})
CASES = [(family, 2, rank) for family in TP_FAMILIES for rank in (0, 1)] + \
    [("three-ranks", 3, rank) for rank in (0, 1, 2)]


def _reference(folder, group: ParallelGroup):
    model = _load_float(folder, CPU, False, None)[2]
    shard_model(model, group)
    return model


def _per_rank(folder, group: ParallelGroup):
    return _load_float(folder, CPU, False, None, shard=lambda m: shard_model(m, group))[2]


def _differences(got, expected) -> list[str]:
    got_params, expected_params = dict(got.named_parameters()), dict(expected.named_parameters())
    assert got_params.keys() == expected_params.keys()
    return [name for name, param in got_params.items()
            if param.dtype != expected_params[name].dtype
            or not torch.equal(param, expected_params[name])]


def _make(folder, family):
    model_type, overrides = THREE_RANKS if family == "three-ranks" else TP_FAMILIES[family]
    make_tiny_model(folder, model_type, **overrides)


@pytest.mark.parametrize("family,world,rank", CASES)
def test_a_rank_loads_exactly_its_cut_of_the_full_model(tmp_path, family, world, rank):
    _make(tmp_path, family)
    group = ParallelGroup(rank, world)
    got, expected = _per_rank(tmp_path, group), _reference(tmp_path, group)
    assert _differences(got, expected) == []
    assert got.kv_arch == expected.kv_arch
    assert not any(p.is_meta for p in got.parameters())


@pytest.mark.parametrize("family", ["llama-bias", "gemma2"])
def test_a_rank_allocated_in_bfloat16_holds_the_float32_loads_values_rounded(tmp_path, family):
    """A bfloat16 rank is allocated in bfloat16 (no float32 piece first): each value is the
    float32 load's, cast, as load_model casts it (Gemma's norm offset added before rounding)."""
    _make(tmp_path, family)
    group = ParallelGroup(1, 2)
    got = _load_float(tmp_path, CPU, False, None, shard=lambda m: shard_model(m, group),
                      dtype=torch.bfloat16)[2]
    assert _differences(got, _reference(tmp_path, group).to(torch.bfloat16)) == []
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}


def test_a_bin_checkpoint_loads_per_rank_alike(tmp_path):
    """PyTorch .bin files are read whole, one at a time, then cut."""
    from safetensors.torch import load_file

    _make(tmp_path, "llama-bias")
    safetensors_file = tmp_path / "model.safetensors"
    torch.save(load_file(safetensors_file), tmp_path / "pytorch_model.bin")
    expected = _reference(tmp_path, ParallelGroup(1, 2))
    safetensors_file.unlink()
    assert _differences(_per_rank(tmp_path, ParallelGroup(1, 2)), expected) == []


def test_a_rank_allocates_its_share_of_the_bytes(tmp_path):
    _make(tmp_path, "llama-bias")
    whole = _load_float(tmp_path, CPU, False, None)[2]
    pieces = [_per_rank(tmp_path, ParallelGroup(rank, 2)) for rank in (0, 1)]
    whole_bytes = _bytes(whole)
    for piece in pieces:  # norms are replicated, so a little over half
        assert 0.45 * whole_bytes < _bytes(piece) < 0.55 * whole_bytes


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_row_pieces_translate_a_full_place_into_a_ranks_rows():
    # qkv of 4 query heads and 2 KV heads of 16: rank 1 of 2 keeps q 32-64, k 80-96, v 112-128
    kept = shard.qkv_rows(shard.head_shard(4, 2, 1, 2), 4, 2, 16)
    assert kept == [range(32, 64), range(80, 96), range(112, 128)]
    piece = shard_load.Piece
    assert shard_load.row_pieces(0, 64, kept) == [piece(range(32, 64), 0)]  # q_proj
    assert shard_load.row_pieces(64, 32, kept) == [piece(range(16, 32), 32)]  # k_proj
    assert shard_load.row_pieces(96, 32, kept) == [piece(range(16, 32), 48)]  # v_proj
    # Phi-3's fused qkv_proj, whole: all three pieces at once
    assert shard_load.row_pieces(0, 128, kept) == [
        piece(range(32, 64), 0), piece(range(80, 96), 32), piece(range(112, 128), 48)]
    # the last rank of an odd vocabulary, and a rank past its end
    assert shard_load.row_pieces(0, 255, [range(128, 255)]) == [piece(range(128, 255), 0)]
    assert shard_load.row_pieces(0, 3, [range(4, 4)]) == []


@pytest.mark.parametrize("piece", ["head_shard", "gate_up_rows"])
def test_the_other_ranks_piece_fails(tmp_path, monkeypatch, piece):
    _make(tmp_path, "llama-bias")
    expected = _reference(tmp_path, ParallelGroup(0, 2))
    monkeypatch.setattr(shard, piece, _exchanged(getattr(shard, piece)))
    assert _differences(_per_rank(tmp_path, ParallelGroup(0, 2)), expected) != []


def test_a_translation_ignoring_the_fused_offset_fails(tmp_path, monkeypatch):
    _make(tmp_path, "llama-bias")
    expected = _reference(tmp_path, ParallelGroup(1, 2))
    row_pieces = shard_load.row_pieces
    monkeypatch.setattr(shard_load, "row_pieces",
                        lambda offset, rows, kept: row_pieces(0, rows, kept))
    got = _per_rank(tmp_path, ParallelGroup(1, 2))  # k and v rows read from q's place
    assert any("qkv_proj" in name for name in _differences(got, expected))
