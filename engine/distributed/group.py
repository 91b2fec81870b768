"""One tensor-parallel group: this process's rank, the world size and the collectives the
sharded layers call. Every collective carries the group's timeout (torch.distributed applies
the process group's timeout to each operation), so a rank that never arrives raises instead of
hanging the step."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Long enough for the slowest step a peer may still be computing (a long prefill chunk on a
# slow device), short enough that a lost rank ends the server well before a client gives up.
TIMEOUT_ENV = "SPECSERVE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0


def collective_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0, got {value!r}")
    return seconds


def backend_for(device: torch.device, world: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo otherwise (CPU, or several ranks on one
    GPU, which NCCL refuses)."""
    if device.type == "cuda" and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def share_cpu_threads(device: torch.device, world: int) -> int:
    """On CPU each rank takes its share of the cores: N ranks of the default thread count each
    would spin N times as many OpenMP threads as there are cores (on 2 cores a tiny model's
    step at 2 ranks took 3.3x as long that way). Returns the count before, to restore."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return before


def rank_device(device: torch.device, rank: int, backend: str) -> torch.device:
    """Rank r's device: cuda:r under NCCL (one GPU each), else the engine's device."""
    if device.type == "cuda" and backend == "nccl":
        return torch.device("cuda", rank)
    return device


@dataclass(frozen=True)
class ParallelGroup:
    """Rank `rank` of `world`; world 1 is a group of one whose collectives do nothing."""

    rank: int
    world: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns it."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates each rank's x along the last dimension, rank 0's first: rank r's piece
        has sizes[r] columns (the last rank's vocabulary piece may be shorter). Every rank gets
        the same full tensor."""
        if self.world == 1:
            return x
        width = max(sizes)
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(pieces, padded.contiguous())
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)


def join(rank: int, world: int, host: str, port: int, device: torch.device,
         timeout_s: float, store_timeout_s: float) -> ParallelGroup:
    """Joins the process group that rank 0's TCP store at host:port rendezvouses (rank 0
    creates the store: `leader_store`); `timeout_s` bounds every collective."""
    store = dist.TCPStore(host, port, world, is_master=False,
                          timeout=timedelta(seconds=store_timeout_s))
    return _init(store, rank, world, device, timeout_s)


def lead(store, world: int, device: torch.device, timeout_s: float) -> ParallelGroup:
    """Rank 0's side of `join`, over the store it created (`leader_store`)."""
    return _init(store, 0, world, device, timeout_s)


def leader_store(world: int, timeout_s: float):
    """Rank 0's rendezvous store on a free localhost port (its `.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _init(store, rank: int, world: int, device: torch.device, timeout_s: float) -> ParallelGroup:
    backend = backend_for(device, world)
    if backend == "nccl":
        torch.cuda.set_device(rank_device(device, rank, backend))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return ParallelGroup(rank, world)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
