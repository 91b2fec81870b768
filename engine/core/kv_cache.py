"""The KV tensors of one model, in fixed-size blocks, sized from a memory budget."""

from __future__ import annotations

import math
import mmap

import torch

from engine.models.architecture import LlamaArchitecture


def bytes_per_block(arch: LlamaArchitecture, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element_size


def num_blocks_for_budget(arch, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    num_blocks = budget_bytes // bytes_per_block(arch, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes / 2**30:.3f} GiB holds not even one block "
            f"({bytes_per_block(arch, block_size, dtype)} bytes); raise --kv-cache-memory"
        )
    return int(num_blocks)


class KVCache:
    """Per layer, a key and a value tensor of shape [num_blocks, block_size, kv_heads, head_dim].

    It knows nothing of requests: block ids come from the block manager.
    """

    def __init__(self, arch: LlamaArchitecture, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self._pages: mmap.mmap | None = None
        if device.type == "cpu":
            self._pages, self.storage = _zeros_untouched(shape, dtype)
        else:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(arch.num_layers)]

    def __getitem__(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_id]

    def __len__(self) -> int:
        return len(self.layers)

    def release_pages(self) -> None:
        """Hands the pages written so far back to the OS; every block reads as zeros again. For
        start-up measurements (cost_probe.py), which write blocks that no request holds: without
        this the default model's probe left 23 MB of a server's resident memory in blocks nobody
        reads. A GPU cache stays as it is."""
        if self._pages is not None:
            self._pages.madvise(mmap.MADV_DONTNEED)


def _zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor]:
    """A zero tensor in private anonymous mmap'd memory, and its mapping: the OS hands out zero
    pages lazily, so the budget is reserved without being resident until blocks are written
    (torch.zeros would touch every page at start: 1 GiB of RSS for the default budget). Private,
    not shared (mmap's default), so that MADV_DONTNEED frees its pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return pages, torch.frombuffer(pages, dtype=dtype, count=math.prod(shape)).view(shape)
