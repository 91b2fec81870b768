"""The packed weights gathered into one huge-page mapping (engine/quant/weight_arena.py): the same
bytes, page-aligned, the first on a 2 MB boundary, backed by huge pages where the kernel allows,
and left where they were where it does not."""

from __future__ import annotations

import pytest
import torch

from engine.quant import weight_arena
from engine.quant.formats import FORMATS
from engine.quant.gguf_weight import GGUFWeight, PackedTensor
Q8_0 = 8  # ggml type id: 34 bytes a 32-value block


def anon_huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:  # a mapping's header: start-end perms ...
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _weights(seed: int = 0) -> list[GGUFWeight]:
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for rows, in_features in ((48, 64), (1536, 576), (16, 32)):
        weight = GGUFWeight(rows, in_features)
        row_bytes = in_features // 32 * FORMATS[Q8_0].block_bytes
        packed = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=generator)
        weight.add(PackedTensor(packed, Q8_0, (rows, in_features)), 0)
        weights.append(weight)
    return weights


def _needs_huge_pages():
    if weight_arena.transparent_huge_pages() in (None, "never"):
        pytest.skip("this kernel has no transparent huge pages")


def test_the_parts_move_with_their_bytes_into_one_aligned_mapping():
    _needs_huge_pages()
    weights = _weights()
    before = [part.packed.clone() for w in weights for part in w.parts]
    mapping = weight_arena.gather_in_huge_pages(weights)
    assert mapping is not None
    parts = [part for w in weights for part in w.parts]
    for part, old in zip(parts, before):
        assert torch.equal(part.packed, old) and part.packed.shape == old.shape
        assert part.packed.data_ptr() % weight_arena.PART_ALIGN == 0
    assert parts[0].packed.data_ptr() % weight_arena.HUGE_PAGE == 0
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert all(start <= p.packed.data_ptr() < end for p in parts)
    # parts do not overlap: in order, each ends before the next starts
    ends = [p.packed.data_ptr() + p.packed.numel() for p in parts]
    assert all(e <= p.packed.data_ptr() for e, p in zip(ends, parts[1:]))


def test_nothing_moves_without_transparent_huge_pages(monkeypatch):
    weights = _weights()
    pointers = [part.packed.data_ptr() for w in weights for part in w.parts]
    monkeypatch.setattr(weight_arena, "transparent_huge_pages", lambda: "never")
    assert weight_arena.gather_in_huge_pages(weights) is None
    assert [part.packed.data_ptr() for w in weights for part in w.parts] == pointers
    # the control: with them, the same weights move
    monkeypatch.setattr(weight_arena, "transparent_huge_pages", lambda: "madvise")
    if hasattr(weight_arena.mmap, "MADV_HUGEPAGE"):
        assert weight_arena.gather_in_huge_pages(weights) is not None
        assert [part.packed.data_ptr() for w in weights for part in w.parts] != pointers


def test_the_default_model_decodes_from_huge_pages(default_llm):
    """Where the kernel has huge pages, the loaded model's packed weights are all in its mapping
    and that mapping is backed by them; an anonymous mapping of the same size that never asked
    for them is not (the control, where huge pages are given only on request). The control is a
    bare mmap, not a torch tensor: torch's allocator or glibc may madvise a large heap block
    themselves (CI saw a plain 100 MB tensor in huge pages). The engine's greedy tokens, computed
    from these weights, are checked against the torch reference in test_int8_engine.py."""
    _needs_huge_pages()
    model = default_llm.engine.runner.model
    mapping = model.weight_mapping
    assert mapping is not None
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    parts = [part for weight in model.gguf_weights() for part in weight.parts]
    assert parts and all(start <= p.packed.data_ptr() < end for p in parts)
    assert anon_huge_kb_at(start) >= 2048
    if weight_arena.transparent_huge_pages() == "madvise":
        plain_mapping = weight_arena.mmap.mmap(
            -1, arena.numel(), flags=weight_arena.mmap.MAP_PRIVATE | weight_arena.mmap.MAP_ANONYMOUS)
        plain = torch.frombuffer(plain_mapping, dtype=torch.uint8)
        plain.fill_(1)
        assert anon_huge_kb_at(plain.data_ptr()) == 0
        del plain
        plain_mapping.close()
