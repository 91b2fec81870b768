"""How followers follow: rank 0's target model announces each call it makes into the model
(hidden states, logits, an embedding lookup, LM-head rows) to the followers before running it;
each follower makes the same call on its own shard, and the collectives inside pair up.

What is announced is the call's inputs (token ids, positions, attention metadata, which KV
cache), never a weight. A call made from inside another announced call (forward's
hidden_states, embed's LM-head rows) is not announced again: the follower's own call makes it.
The logits call carries its hidden rows: after the all-reduce they are the same on every rank,
and sending them keeps the followers free of rank 0's bookkeeping (which rows, which step).
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Callable

import torch

from engine.core.kv_cache import KVCache

OPS = ("hidden_states", "logits", "embed", "lm_head_rows")


def encode(message) -> bytes:
    """A command as bytes: torch's format, so tensors travel on any device and arrive on the
    follower's (`decode`'s map_location)."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def decode(data: bytes, device: torch.device):
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


class LeaderMirror:
    """Rank 0's side: patches the model's entry points so that each announces itself.
    `send(bytes)` delivers a command to every follower; `check()` raises if one is dead."""

    def __init__(self, model, send: Callable[[bytes], None], check: Callable[[], None]):
        self.model, self._send, self._check = model, send, check
        self._depth = 0
        self._main: KVCache | None = None
        self._scratch = weakref.WeakKeyDictionary()  # KVCache -> key
        self._num_scratch = 0
        originals = {"hidden_states": model.hidden_states, "logits": model.logits,
                     "embed": model.embed, "lm_head_rows": model.lm_head.embedding}
        model.hidden_states = self._announced(originals["hidden_states"], self._hidden_args)
        model.logits = self._announced(originals["logits"], self._logits_args)
        model.embed = self._announced(originals["embed"], lambda ids: {"ids": ids})
        model.lm_head.embedding = self._announced(originals["lm_head_rows"],
                                                  lambda ids: {"ids": ids}, "lm_head_rows")

    def set_main_cache(self, kv_cache: KVCache) -> None:
        """The engine's KV cache: each follower builds its own of the same blocks."""
        self._main = kv_cache
        self._send(encode(("main_cache", _cache_shape(kv_cache))))

    def _announced(self, original, arguments, op: str | None = None):
        op = op or original.__name__

        def call(*args, **kwargs):
            if self._depth:  # inside an announced call: the follower makes this one itself
                return original(*args, **kwargs)
            self._check()
            self._send(encode((op, arguments(*args, **kwargs))))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def _hidden_args(self, input_ids, positions, kv_caches, meta, layer_ids=None,
                     capture_features: bool = True) -> dict:
        return {"input_ids": input_ids, "positions": positions, "cache": self._cache_ref(kv_caches),
                "meta": meta, "layer_ids": None if layer_ids is None else list(layer_ids),
                "capture_features": capture_features}

    def _logits_args(self, hidden, rows) -> dict:
        return {"rows": hidden[rows, :self.model.arch.hidden_size]}

    def _cache_ref(self, kv_cache) -> tuple:
        """("main",) or ("scratch", key, shape): a cache the engine made for a probe (cost
        probe, layer-skip's, the memory profile) is mirrored by a fresh one of its shape."""
        if kv_cache is self._main:
            return ("main",)
        if kv_cache not in self._scratch:
            self._num_scratch += 1
            self._scratch[kv_cache] = self._num_scratch
        return ("scratch", self._scratch[kv_cache], _cache_shape(kv_cache))


def _cache_shape(kv_cache: KVCache) -> tuple[int, int, str]:
    return kv_cache.num_blocks, kv_cache.block_size, str(kv_cache.storage.dtype)


class Follower:
    """A follower's side: runs each announced call on its own shard, with its own caches (the
    main one, and the latest scratch one)."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.main: KVCache | None = None
        self.scratch: tuple[int, KVCache] | None = None

    def handle(self, op: str, args) -> bool:
        """Runs one command; False on "stop"."""
        if op == "stop":
            return False
        if op == "main_cache":
            self.main = self._new_cache(args)
        elif op == "hidden_states":
            self.model.hidden_states(args["input_ids"], args["positions"],
                                     self._cache(args["cache"]), args["meta"],
                                     args["layer_ids"], args["capture_features"])
        elif op == "logits":
            rows = args["rows"]
            self.model.logits(rows, torch.arange(rows.shape[0], device=rows.device))
        elif op == "embed":
            self.model.embed(args["ids"])
        elif op == "lm_head_rows":
            self.model.lm_head.embedding(args["ids"])
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")
        return True

    def _cache(self, ref: tuple) -> KVCache:
        if ref[0] == "main":
            return self.main
        _, key, shape = ref
        if self.scratch is None or self.scratch[0] != key:
            self.scratch = None  # the previous one's memory first
            self.scratch = (key, self._new_cache(shape))
        return self.scratch[1]

    def _new_cache(self, shape: tuple[int, int, str]) -> KVCache:
        num_blocks, block_size, dtype = shape
        return KVCache(self.model.kv_arch, num_blocks, block_size,
                       getattr(torch, dtype.removeprefix("torch.")), self.device)
