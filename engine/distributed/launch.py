"""Rank 0 starts ranks 1..N-1 (`python -m engine.distributed.follower`), hands each the engine
config over an authenticated localhost socket, joins the process group with them and watches
them: a follower that exits while the engine runs is a dead rank, and the engine stops (every
request in flight fails, the server exits non-zero: engine/failures.py's path)."""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, deliver_challenge

import torch

from engine.distributed import group as groups
from engine.distributed.mirror import LeaderMirror
from engine.distributed.shard import check_shardable
from engine.distributed.shard_model import shard_model

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "SPECSERVE_TP_AUTHKEY"
STOP_WAIT_S = 5.0
# Followers import torch and the engine before they connect (3 s on a 2-core CPU); a follower
# that exits meanwhile is noticed at once, one that is merely slow gets this long.
START_TIMEOUT_S = 300.0


class RankDeadError(RuntimeError):
    """A tensor-parallel rank exited: no step can complete any more."""


class Followers:
    """Rank 0's handle on the other ranks: their processes, command connections and group."""

    def __init__(self, config, device: torch.device):
        world = config.model.tensor_parallel_size
        self.world, self.dead_error = world, None
        self._closing = threading.Event()  # set once the followers are asked to stop
        self._listeners: list[Callable[[BaseException], None]] = []
        timeout_s = groups.collective_timeout_s()
        authkey = secrets.token_bytes(32)
        server = socket.create_server(("127.0.0.1", 0))
        store = groups.leader_store(world, START_TIMEOUT_S)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "engine.distributed.follower", str(rank), str(world),
             str(server.getsockname()[1]), str(store.port)], env=env)
            for rank in range(1, world)]
        try:
            self._connections = _accept(server, self.processes, authkey, START_TIMEOUT_S)
            for connection in self._connections:
                connection.send_bytes(pickle.dumps(config))
            self.group = groups.lead(store, world, device, timeout_s)
        except BaseException:
            _stop(self.processes, [], self._closing)
            raise
        finally:
            server.close()
        threads_before = groups.share_cpu_threads(device, world)
        self.mirror: LeaderMirror | None = None
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._connections,
                                           self._closing, threads_before)
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=_watch, args=(weakref.ref(self), rank, process),
                             name=f"specserve-tp-watch-{rank}", daemon=True).start()
        logger.info("tensor parallel: %d ranks (%s), followers' pids %s", world,
                    torch.distributed.get_backend(), [p.pid for p in self.processes])

    # ------------------------------------------------------------------ the engine's calls
    def shard(self, model) -> None:
        """The loader's hook: this rank's piece of every weight. A model the ranks cannot split
        (ValueError) stops the followers before the error reaches the caller."""
        try:
            shard_model(model, self.group)
        except BaseException:
            self.close()
            raise

    def follow(self, model) -> None:
        """Waits for every follower's model (START_TIMEOUT_S at most), then makes rank 0's
        model announce its calls."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, connection in enumerate(self._connections, start=1):
            while not connection.poll(0.5):
                self.check()
                if time.monotonic() > deadline:
                    self.close()
                    raise RankDeadError(f"tensor-parallel rank {rank} did not load its shard "
                                        f"in {START_TIMEOUT_S:.0f} s")
            if connection.recv_bytes() != b"ready":
                raise RuntimeError(f"tensor-parallel rank {rank} did not start")
        fused = [layer for layer in model.layers if getattr(layer, "fused", False)]
        for layer in fused:  # fused Triton layers add the residual before any all-reduce
            layer.fused = False
        if fused:
            logger.info("fused kernels off under tensor parallelism (%d layers)", len(fused))
        self.mirror = LeaderMirror(model, self._send, self.check)

    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        """`listener(error)` is called once, on a watcher thread, if a follower dies."""
        self._listeners.append(listener)
        if self.dead_error is not None:
            listener(self.dead_error)

    def check(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def close(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ inside
    def _send(self, data: bytes) -> None:
        try:
            for connection in self._connections:
                connection.send_bytes(data)
        except OSError as error:  # a follower gone between the check and the send
            raise self.dead_error or RankDeadError(f"a tensor-parallel rank is gone: {error}")

    def _died(self, rank: int, status: int) -> None:
        if self._closing.is_set() or self.dead_error is not None:
            return
        self.dead_error = RankDeadError(f"tensor-parallel rank {rank} exited with status "
                                        f"{status}")
        logger.critical("%s; the engine stops", self.dead_error)
        for listener in self._listeners:
            listener(self.dead_error)


def _accept(server: socket.socket, processes, authkey: bytes,
            timeout_s: float) -> list[Connection]:
    """One authenticated connection per follower, in rank order; raises where a follower exits
    or does not connect within the timeout."""
    server.settimeout(0.5)
    by_rank: dict[int, Connection] = {}
    deadline = time.monotonic() + timeout_s
    while len(by_rank) < len(processes):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise RankDeadError(f"tensor-parallel rank {rank} exited with status "
                                    f"{process.returncode} while starting")
        if time.monotonic() > deadline:
            raise RankDeadError(f"tensor-parallel followers did not connect in {timeout_s} s")
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        sock.settimeout(None)
        connection = Connection(sock.detach())
        deliver_challenge(connection, authkey)
        by_rank[pickle.loads(connection.recv_bytes())] = connection
    return [by_rank[rank] for rank in sorted(by_rank)]


def _watch(followers_ref, rank: int, process: subprocess.Popen) -> None:
    status = process.wait()
    followers = followers_ref()
    if followers is not None:
        followers._died(rank, status)


def _stop(processes, connections, closing: threading.Event,
          threads_before: int | None = None) -> None:
    """Asks every follower to stop, then ends those still running after STOP_WAIT_S; gives
    this process its CPU threads back."""
    from engine.distributed.mirror import encode

    closing.set()
    for connection in connections:
        try:
            connection.send_bytes(encode(("stop", None)))
            connection.close()
        except OSError:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    groups.leave()
    if threads_before is not None:
        torch.set_num_threads(threads_before)


def start_tensor_parallel(config, device: torch.device) -> Followers | None:
    """The followers of a --tensor-parallel-size N > 1 engine, or None for one rank. Raises
    ValueError, before any process starts, where the model's heads or sizes do not divide."""
    if config.model.tensor_parallel_size == 1:
        return None
    check_shardable(_architecture(config.model.model), config.model.tensor_parallel_size)
    if torch.distributed.is_initialized():  # torch's default process group is one a process
        raise ValueError("one tensor-parallel engine a process: close the other one first "
                         "(engine.parallel.close())")
    return Followers(config, device)


def _architecture(model: str | None):
    """The model's architecture from its config alone (no weights read)."""
    from engine.core.cache_dir import cache_dir
    from engine.models import gguf_native
    from engine.models.architecture import LlamaArchitecture
    from engine.models.loader import locate_model

    path, _ = locate_model(model)
    if path.is_file():
        gguf_native.check_gguf(path)
        hf_config = gguf_native.read_config(gguf_native.metadata_folder(path, cache_dir()))
    else:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
    return LlamaArchitecture.from_hf_config(hf_config)
