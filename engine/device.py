"""The one place that knows about accelerators: device choice, default dtype, memory, sync."""

from __future__ import annotations

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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
