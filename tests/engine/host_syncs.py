"""Counts the places where a step would make the host wait for an accelerator.

On CUDA the host waits whenever it reads a device value (`.tolist()`, `.item()`, `bool(t)`, a
boolean-mask index, `nonzero`) and whenever it copies host data in blocking mode
(`torch.tensor(data, device=...)`, `.to(device)` without `non_blocking=True`). The counter sees
these at the call sites, whatever the device, so the one-sync property of a step is tested on
CPU too, where the same code runs.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}
# aten ops whose output size or value depends on device data: they sync inside.
_SYNCING_OPS = ("aten.nonzero", "aten.masked_select", "aten._local_scalar_dense")


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/engine/" in frame.filename:
            return f"{frame.filename.rsplit('/engine/', 1)[1]}:{frame.lineno} {frame.line}"
    return "?"


def _names_a_device(args, kwargs) -> bool:
    values = list(args) + [kwargs.get("device")]
    return any(isinstance(v, torch.device) or (isinstance(v, str) and v.split(":")[0] in
                                              ("cpu", "cuda", "mps", "xpu")) for v in values)


class HostSyncs:
    def __init__(self):
        self.reads: Counter[str] = Counter()  # device -> host reads
        self.blocking_copies: Counter[str] = Counter()  # host -> device copies that wait

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())


class _Functions(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.syncs.reads[f"{name} at {_site()}"] += 1
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.syncs.blocking_copies[f"{name} at {_site()}"] += 1
        elif name in ("to", "cuda", "copy_") and not kwargs.get("non_blocking") \
                and _names_a_device(args[1:], kwargs):
            self.syncs.blocking_copies[f"{name} at {_site()}"] += 1
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        # `.item()` and friends are counted where they are called; their aten op is the same read.
        if name.startswith(_SYNCING_OPS) and not name.startswith("aten._local_scalar_dense"):
            self.syncs.reads[f"{name} at {_site()}"] += 1
        elif name.startswith("aten.index") and len(args) > 1 and isinstance(args[1], (list, tuple)) \
                and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.syncs.reads[f"boolean-mask {name} at {_site()}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_syncs():
    syncs = HostSyncs()
    with _Functions(syncs), _Ops(syncs):
        yield syncs
