"""NaN logits rows: zeroed on the device before sampling, flagged, and read with the step's
tokens; a request with a NaN row fails alone (engine/failures.py for synchronous steps,
engine/runner/overlap.py for overlapped ones)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sample.verifier import RowFlags


def zero_nan_rows(logits: torch.Tensor) -> RowFlags:
    """Zeroes the logits rows holding a NaN, on the device, so that the batch's sampling sees
    finite numbers, and flags them (1) for the step's one read (verifier.RowFlags)."""
    # A row's max is NaN where any of its logits is: one read of the logits and no [rows, vocab]
    # mask (isnan().any() cost 0.7 ms of a 16-row CPU step, this 50 us). The fill stays
    # unconditional: asking whether any row is NaN would wait for a GPU. On a CPU it reads every
    # logit, ~22 us a row (AMD EPYC Zen 4); asking there instead would be a read that the CPU
    # runs and CUDA does not, in a step test_host_syncs holds to one read on every device.
    nan_rows = torch.isnan(logits.amax(dim=-1))  # [num_rows]
    with torch.inference_mode():
        logits.masked_fill_(nan_rows[:, None], 0.0)
    return RowFlags(nan_rows.long())


def nan_requests(requests: Sequence, row_starts: Sequence[int],
                 row_is_nan: Sequence[int]) -> dict[str, str]:
    """{request id: message} for requests with a NaN in any of their logits rows."""
    return {request.request_id: "the model's logits for this request are NaN"
            for request, start in zip(requests, row_starts)
            if any(row_is_nan[start:start + len(request.draft_token_ids) + 1])}
