"""The one place that knows about accelerators: device choice, default dtype, memory, sync."""

from __future__ import annotations

import ctypes
import gc
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (CPUs without native bf16 run it ~6x slower) and bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def free_memory_bytes(device: torch.device) -> int | None:
    """Free accelerator memory, or None on CPU (where the KV budget is set explicitly)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return None


def release_cached_memory(device: torch.device) -> None:
    """Returns to the card what this process's allocator still caches for tensors already gone
    (an engine dropped before another is made), so that it counts as free at start."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def release_freed_host_memory() -> None:
    """Hands the pages of freed host allocations back to the OS: glibc's malloc_trim over every
    malloc arena. Loading repacks every weight through temporaries, and glibc keeps the freed
    pages of a thread's arena resident: 38 MB of a CPU server's RSS right after start (477 ->
    439 MB measured). No-op where libc has no malloc_trim."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def total_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return total
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors -> the same tensors on `device`, in one non-blocking copy.

    A blocking copy from pageable memory makes the host wait for the device to drain its queue;
    a step that built its inputs that way waited a dozen times. Here they are packed into one
    pinned buffer and sent together: the host never waits, and the copy is ordered before the
    kernels that read it. On CPU the tensors are returned as they are."""
    if device.type == "cpu" or not tensors:
        return list(tensors)
    packed = _pinned(torch.cat([t.reshape(-1) for t in tensors])).to(device, non_blocking=True)
    return _unpacked(packed, tensors)


def _unpacked(packed: torch.Tensor, shapes_of: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `packed`, one per tensor of `shapes_of`, in order and of its shape."""
    out, offset = [], 0
    for t in shapes_of:
        out.append(packed[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class StagedCopy:
    """Host int64 tensors to the device through pinned buffers that live as long as the caller:
    `copy_to_device` without pinning a fresh host buffer each step (measured on an H100, a
    padded step's input copy was the largest host cost before the launch). Two buffers take
    turns, so a step may fill one while the copy out of the other is still in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0

    def send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.device.type == "cpu" or not tensors:
            return list(tensors)
        total = sum(t.numel() for t in tensors)
        if not self._buffers or self._buffers[0][0].numel() < total:
            size = max(total, 2 * self._buffers[0][0].numel() if self._buffers else 4096)
            self._buffers = [(torch.empty(size, dtype=torch.long).pin_memory(),
                              torch.empty(size, dtype=torch.long, device=self.device))
                             for _ in range(2)]
        host, on_device = self._buffers[self._turn]
        self._turn ^= 1
        torch.cat([t.reshape(-1) for t in tensors], out=host[:total])
        on_device[:total].copy_(host[:total], non_blocking=True)
        return _unpacked(on_device, tensors)


class PendingRead:
    """Tokens on their way to the host: the copy was queued behind the kernels that make them,
    and `result()` waits for it alone (not for work queued later)."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu":  # a copy: the tensor may be a buffer the next step writes
            self._host, self._event = tensor.clone(), None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host tensor (any dtype) to `device` without making the host wait."""
    if device.type == "cpu":
        return tensor
    return _pinned(tensor).to(device, non_blocking=True)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory. A tensor already on an accelerator stays as it is (only
    host memory pins): under `torch.set_default_device` or a `with torch.device(...)` context,
    tensors made without a device, the steps' "host" tensors too, are made there."""
    return tensor.pin_memory() if tensor.device.type == "cpu" else tensor


def is_resource_error(error: BaseException) -> bool:
    """Errors that say the process is short of memory (host or device), never one request's
    fault: a step that raises one fails the engine, not a request."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError))
