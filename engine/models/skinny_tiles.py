"""How the fused skinny GEMMs (skinny_gemm.py) cut a weight: chosen from its shape alone.

A tile that followed the row count would sum a row's products in another order at another batch
size; with the tiles a function of (kind, out columns, in columns) only, a row's result is bitwise
the same whatever rows share its step (the row invariance --batch-invariant relies on).

`TUNED` holds the tiles a GPU measured best per shape (benchmarks/fused_tiles.py prints the
entries to paste here); `default_tiles` is the untuned guess used elsewhere. Nothing in this table
has been timed on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_ROWS = 16  # rows a program multiplies: fixed, the smallest side tl.dot takes on a GPU
MAX_ROWS = 64  # the widest step the fused path takes (decode batches, verify steps)
# Programs to aim for: about two per SM of an H100/H200 (132), so that one program's weight loads
# are in flight while another's wait (a guess until benchmarks/fused_tiles.py has run).
TARGET_PROGRAMS = 256


@dataclass(frozen=True)
class Tiles:
    """One program's share of a product."""

    block_n: int  # output columns (per half, for the paired kinds) a program computes
    block_k: int = 64  # inner columns summed a step, in order
    num_warps: int = 4
    num_stages: int = 3


# (kind, columns a program pairs or computes in all, inner size) -> Tiles, as measured. Kinds:
# "qkv" (RMSNorm + QKV + RoPE + KV store), "gate_up" (RMSNorm + gate/up + SiLU), "linear"
# (a projection plus the residual). Empty until a GPU has measured them.
TUNED: dict[tuple[str, int, int], Tiles] = {}


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def default_tiles(kind: str, out_columns: int, in_features: int, half_head: int = 0) -> Tiles:
    """Untuned: columns per program so that about TARGET_PROGRAMS programs run, 16 to 64 of them
    (the default model's products all get 16; the 8B shape's gate/up 32); for "qkv" at most half a head, as a
    program rotates the two halves it owns against each other."""
    block_n = min(64, max(16, _floor_power_of_two(out_columns // TARGET_PROGRAMS)))
    if kind == "qkv":
        block_n = min(block_n, half_head)
    block_k = 128 if in_features >= 2048 else 64
    return Tiles(block_n, block_k)


def tiles_for(kind: str, out_columns: int, in_features: int, half_head: int = 0) -> Tiles:
    """The tiles of a product of this kind and shape: measured where `TUNED` has them."""
    return TUNED.get((kind, out_columns, in_features)) \
        or default_tiles(kind, out_columns, in_features, half_head)
