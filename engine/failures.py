"""Failures in one step, sorted by whom they belong to.

A step's per-request parts (a request's grammar masks, its logits rows, its verification, its
detokenization) can fail for that request alone: a grammar past its limits, NaN logits, a
tokenizer error. Such a request ends with an error (`finish_reason` "error" and a message), its
KV freed, and the batch goes on. Anything else that raises in a step (the model's forward, the
scheduler, out of memory wherever it happens) is no one request's: the step raises, and the
engine's owner (`AsyncEngine`) fails every request and stops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.device import is_resource_error
from engine.sample.nan_rows import nan_requests, zero_nan_rows
from engine.sample.verifier import verify_requests


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def verify_step(requests: Sequence, row_starts: Sequence[int], logits: torch.Tensor,
                draft_probs: dict, generator: torch.Generator, bitmask: torch.Tensor | None,
                faults, failed: dict[str, str]) -> list[list[int]]:
    """The step's emitted tokens per request (engine.sample.verifier), requests with NaN rows or
    whose verification fails alone recorded in `failed` and emitting nothing. The NaN check is
    read with the step's tokens: no second wait for the device."""
    faults.corrupt_logits(requests, row_starts, logits)
    nan_flags = zero_nan_rows(logits, not all(r.sampling_params.greedy for r in requests))

    def verify(some, starts):
        faults.raise_if("row_error", some)
        if len(some) == len(requests):
            return verify_requests(some, starts, logits, draft_probs, generator, bitmask,
                                   nan_flags)
        rows = slice(starts[0], starts[0] + len(some[0].draft_token_ids) + 1)  # one alone
        return verify_requests(some, [0], logits[rows], draft_probs, generator,
                               None if bitmask is None else bitmask[rows])

    emitted = verify_isolated(verify, requests, row_starts, failed)
    for request_id, message in nan_requests(requests, row_starts, nan_flags.read()).items():
        failed.setdefault(request_id, message)
    return [[] if r.request_id in failed else tokens for r, tokens in zip(requests, emitted)]


def verify_isolated(verify: Callable, requests: Sequence, row_starts: Sequence[int],
                    failed: dict[str, str]) -> list[list[int]]:
    """`verify(requests, row_starts)` for the whole batch; if it raises, each request alone, so
    that only the ones that fail alone fail (recorded in `failed`, emitting nothing). Raises
    the batch's error where it is a resource error, or where every one of several requests
    fails alone (then it is no one request's)."""
    try:
        return verify(requests, row_starts)
    except Exception as error:
        if is_resource_error(error):
            raise
        batch_error = error
    emitted, errors = [], {}
    for request, start in zip(requests, row_starts):
        try:
            [tokens] = verify([request], [start])
        except Exception as error:
            if is_resource_error(error):
                raise
            errors[request.request_id] = describe(error)
            tokens = []
        emitted.append(tokens)
    if len(errors) == len(requests) > 1:
        raise batch_error
    failed.update(errors)
    return emitted
