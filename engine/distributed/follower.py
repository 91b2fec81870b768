"""A follower rank's process: `python -m engine.distributed.follower RANK WORLD PORT STORE_PORT`,
started by rank 0 (launch.py). It connects back, receives the engine config, joins the process
group, loads and shards the same model, says "ready", then runs each call rank 0 announces
(mirror.Follower) until told to stop or until rank 0 is gone (its connection closes). Any error
(a collective timing out included) ends the process with status 1, which rank 0 sees."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
from multiprocessing.connection import Connection, answer_challenge

logger = logging.getLogger("engine.distributed.follower")


def main(argv: list[str]) -> int:
    rank, world, port, store_port = (int(a) for a in argv)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    connection = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    answer_challenge(connection, bytes.fromhex(os.environ.pop("SPECSERVE_TP_AUTHKEY")))
    connection.send_bytes(pickle.dumps(rank))
    config = pickle.loads(connection.recv_bytes())
    model, device = _load(config, rank, world, store_port)
    connection.send_bytes(b"ready")
    return _serve(connection, model, device)


def _load(config, rank: int, world: int, store_port: int):
    import torch

    from engine.attention import triton_backend
    from engine.core.device import pick_device, pick_dtype
    from engine.distributed import group as groups
    from engine.distributed.launch import START_TIMEOUT_S
    from engine.distributed.shard_model import shard_model
    from engine.models.loader import load_model

    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    group = groups.join(rank, world, "127.0.0.1", store_port, device,
                        groups.collective_timeout_s(), START_TIMEOUT_S)
    device = groups.rank_device(device, rank, groups.backend_for(device, world))
    groups.share_cpu_threads(device, world)
    loaded = load_model(config.model.model, device, dtype, with_tokenizer=False,
                        quantization=config.model.quantization,
                        max_model_len=config.model.max_model_len,
                        shard=lambda model: shard_model(model, group))
    model = loaded.model
    backend = triton_backend.resolve(config.model.attention_backend, device)
    model.set_attention_backend(backend)
    if config.model.batch_invariant:
        model.use_batch_invariant_kernels(device, dtype, backend)
    torch.set_grad_enabled(False)
    return model, device


def _serve(connection: Connection, model, device) -> int:
    from engine.distributed.mirror import Follower, decode

    follower = Follower(model, device)
    while True:
        try:
            data = connection.recv_bytes()
        except (EOFError, OSError):
            logger.warning("rank 0 is gone; this rank stops")
            return 0
        op, args = decode(data, device)
        if not follower.handle(op, args):
            return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except BaseException:
        logger.exception("tensor-parallel follower failed")
        status = 1
    # os._exit: torch.distributed's teardown at interpreter exit can wait on peers that are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
