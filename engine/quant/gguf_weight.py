"""A linear layer's weight kept in GGUF blocks, multiplied without a float32 copy of it.

A weight may be fused from parts of different block formats (a Q4_K_M file stores some v
projections in Q6_K next to Q4_K q and k); each part is a row range of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant import formats, int8
from engine.quant.formats import BlockFormat
from engine.quant.kernels import load_kernel


@dataclass(frozen=True)
class PackedTensor:
    """A checkpoint tensor still in its GGUF blocks: what the GGUF loader hands the model."""

    packed: torch.Tensor  # [rows, row_bytes] uint8
    ggml_type: int
    shape: tuple[int, int]  # (rows, in_features), the logical float shape

    def dequantize(self) -> torch.Tensor:  # [rows, in_features] float32
        return formats.dequantize(self.packed, self.ggml_type, self.shape[1])


@dataclass
class _Part:
    packed: torch.Tensor  # [rows, row_bytes] uint8
    fmt: BlockFormat
    out_offset: int

    @property
    def rows(self) -> int:
        return self.packed.shape[0]


class GGUFWeight:
    """W [out_features, in_features] as packed GGUF rows; `matmul` computes x W^T."""

    def __init__(self, out_features: int, in_features: int):
        self.out_features = out_features
        self.in_features = in_features
        self.parts: list[_Part] = []

    def add(self, tensor: PackedTensor, out_offset: int) -> None:
        rows, in_features = tensor.shape
        if in_features != self.in_features or out_offset + rows > self.out_features:
            raise ValueError(f"packed tensor {tuple(tensor.shape)} does not fit rows "
                             f"{out_offset}.. of a [{self.out_features}, {self.in_features}] weight")
        self.parts.append(_Part(tensor.packed, formats.FORMATS[tensor.ggml_type], out_offset))
        self.parts.sort(key=lambda p: p.out_offset)
        self._merge_neighbours()

    def _merge_neighbours(self) -> None:
        """Adjacent parts of one format become one (q, k and v of a Q4_1 file: one kernel call)."""
        merged: list[_Part] = []
        for part in self.parts:
            last = merged[-1] if merged else None
            if last and last.fmt == part.fmt and last.out_offset + last.rows == part.out_offset:
                merged[-1] = _Part(torch.cat([last.packed, part.packed]), part.fmt,
                                   last.out_offset)
            else:
                merged.append(part)
        self.parts = merged

    @property
    def complete(self) -> bool:
        return sum(p.rows for p in self.parts) == self.out_features

    @property
    def nbytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts)

    @property
    def on_integer_kernels(self) -> bool:
        """Some part runs int8 activations and integer dot products (`use_integer_kernels`)."""
        return any(p.fmt.ggml_type in int8.ORIGINAL for p in self.parts)

    @property
    def format_names(self) -> list[str]:
        return [p.fmt.name for p in self.parts]

    def use_integer_kernels(self) -> None:
        """Moves every part of a format the integer kernels take (Q4_1, Q8_0, in 16-row groups) to
        them: activations quantized to int8 blocks, as llama.cpp computes (engine/quant/int8.py).
        The other parts keep float32 activations."""
        for index, part in enumerate(self.parts):
            if int8.repackable(part.fmt.ggml_type, part.rows, self.in_features):
                int_type = int8.REPACKED[part.fmt.ggml_type]
                self.parts[index] = _Part(int8.repack(part.packed, part.fmt.ggml_type),
                                          formats.FORMATS[int_type], part.out_offset)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out] float32
        kernel = load_kernel()
        if kernel is not None and len(self.parts) == 1 and x.dtype == torch.float32:
            part = self.parts[0]
            return kernel.matmul(x, part.packed, part.fmt.ggml_type)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # [N, in]
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for part in self.parts:
            target = out.narrow(1, part.out_offset, part.rows)
            if kernel is not None:
                kernel.matmul_out(x2, part.packed, part.fmt.ggml_type, target)
            elif part.fmt.ggml_type in int8.ORIGINAL:
                target.copy_(int8.reference_matmul(x2, part.packed, part.fmt.ggml_type))
            else:
                weight = formats.dequantize(part.packed, part.fmt.ggml_type, self.in_features)
                target.copy_(x2 @ weight.t())
        return out.view(*lead, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in_features] float32
        """Dequantized rows: the embedding lookup of a tied vocabulary matrix."""
        if len(self.parts) != 1:
            raise ValueError("row lookup needs a weight stored in one block format")
        part, ggml_type = self.parts[0], self.parts[0].fmt.ggml_type
        kernel = load_kernel()
        if ggml_type in int8.ORIGINAL:  # rows are spread over their 16-row group: regroup them
            picked = int8.unpack_rows(part.packed, ggml_type, ids) if kernel is None \
                else kernel.int8_unpack_rows(part.packed, ggml_type, ids)
            ggml_type = int8.ORIGINAL[ggml_type]
        else:
            picked = part.packed.index_select(0, ids.reshape(-1))
        if kernel is not None:
            return kernel.dequantize(picked, ggml_type, self.in_features)
        return formats.dequantize(picked, ggml_type, self.in_features)
