"""A compiled grammar's trial run, before any request depends on it.

llguidance builds its lexer and parser states lazily, so a grammar past the engine's limits (an
Earley row of more than `max_items_in_row` items, a regex whose lexer outgrows its expression
limit) often compiles and gives a first mask, then fails one or two tokens later. The probe walks
a few short paths through the grammar (the forced tokens, else allowed tokens chosen by a seeded
draw, the first walk taking the lowest allowed id) and computes every mask on the way, under the
same limits a request runs with, so such a grammar is refused at admission, not mid-generation.

A failure the probe did not reach still cannot become output: the engine checks every mask and
every emitted token, and a request whose grammar fails ends with an error.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import torch

NUM_WALKS = 4
WALK_TOKENS = 12


class ProbeTimeout(Exception):
    """The probe ran past its deadline."""


def probe(matcher, vocab_size: int, eos_token_ids: frozenset[int],
          deadline: float | None = None, num_walks: int = NUM_WALKS) -> str | None:
    """The grammar's error on the probe's walks, or None; `matcher` itself is left as it was.
    Raises ProbeTimeout past `deadline` (time.monotonic()), checked between masks."""
    scratch = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
    for walk in range(num_walks):
        error = _walk(matcher.deep_copy(), scratch, random.Random(walk), walk == 0,
                      eos_token_ids, deadline)
        if error is not None:
            return error
    return None


def schema_patterns(schema_text: str) -> list[str]:
    """Every regular expression a JSON schema holds (`pattern`, `patternProperties`' keys), each
    once, in the order met."""
    found: dict[str, None] = {}
    stack = [json.loads(schema_text)]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(reversed(list(node.values())))
    return list(found)


def _walk(matcher, scratch: torch.Tensor, rng: random.Random, lowest: bool,
          eos_token_ids: frozenset[int], deadline: float | None) -> str | None:
    for _ in range(WALK_TOKENS):
        if deadline is not None and time.monotonic() > deadline:
            raise ProbeTimeout()
        if matcher.is_error():  # (an error also reads as stopped)
            return matcher.get_error()
        if matcher.is_stopped():
            return None
        matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if matcher.is_error():
            return matcher.get_error()
        forced = matcher.compute_ff_tokens()
        if matcher.is_error():
            return matcher.get_error()
        if forced:
            token_id = forced[0]
        else:
            allowed = allowed_token_ids(scratch)
            allowed = allowed[~np.isin(allowed, list(eos_token_ids))]
            if not allowed.size:
                if not matcher.is_accepting():
                    return "the grammar allows no token at some point of its text"
                return None
            token_id = int(allowed[0 if lowest else rng.randrange(allowed.size)])
        matcher.consume_token(token_id)
        if matcher.is_error():
            return matcher.get_error()
    return None


def allowed_token_ids(bitmask_row: torch.Tensor) -> np.ndarray:
    """The token ids a [words] int32 mask row allows, ascending."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)
