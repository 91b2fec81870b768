"""Token masks for the rows of a step's logits: built on the host from each constrained request's
matcher, unpacked to booleans on the logits' device, applied before any other processing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.device import is_resource_error, to_device
from engine.quant.kernels import cpu_ops_for, cpu_ops_on


def allocate_bitmask(num_rows: int, num_words: int) -> torch.Tensor:  # [num_rows, words] int32
    """All bits set: rows no matcher writes allow every token."""
    return torch.full((num_rows, num_words), -1, dtype=torch.int32)


def build_bitmask(requests: Sequence, row_starts: Sequence[int], num_rows: int,
                  failed: dict[str, str] | None = None,
                  before_fill: Callable | None = None) -> torch.Tensor | None:
    """Rows row_start + j of a constrained request allow what its grammar allows after its
    drafts[:j]; None when no request in the step is constrained. With `failed`, a request whose
    masks raise (its grammar past its limits) is recorded there by id, its rows left allowing
    every token (never sampled from: it ends with an error), and the others go on.
    `before_fill(request)`: a test's fault hook (engine/faults.py)."""
    constrained = [(r, start) for r, start in zip(requests, row_starts) if r.grammar is not None]
    if not constrained:
        return None
    bitmask = allocate_bitmask(num_rows, constrained[0][0].grammar.num_mask_words)
    for request, start in constrained:
        try:
            if before_fill is not None:
                before_fill(request)
            request.grammar.fill_masks(bitmask, start, request.draft_token_ids)
        except Exception as error:
            if failed is None or is_resource_error(error):
                raise
            failed[request.request_id] = f"the request's grammar failed: {error}"
            bitmask[start:start + len(request.draft_token_ids) + 1] = -1
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int,
                   device: torch.device) -> torch.Tensor:  # [num_rows, vocab] bool
    words = to_device(bitmask, device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [num_rows, words, 32]
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor,
                in_place: bool = False) -> torch.Tensor:
    """The logits with every token the bitmask ([rows, words] int32 on the host) does not allow
    at -inf: in one compiled pass on CPU, unpacked on the logits' device elsewhere. A new tensor,
    or `logits` itself overwritten where `in_place` (callers that never read the raw logits
    again: then only the refused tokens are written, not every row copied)."""
    fused = cpu_ops_for(logits)
    if fused is not None and logits.dim() == 2 and logits.is_contiguous():
        if in_place:
            fused.mask_logits_(logits, bitmask)
            return logits
        return fused.mask_logits(logits, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
    if not in_place:
        return apply_allowed(logits, allowed)
    with torch.inference_mode():  # the model's logits are inference tensors (its forward is
        return logits.masked_fill_(~allowed, float("-inf"))  # in inference mode): writable here


def known_next_tokens(requests: Sequence, row_starts: Sequence[int],
                      bitmask: torch.Tensor | None) -> dict[int, int]:
    """Logits rows whose next token the grammar alone decides (its mask allows exactly one
    token), as {row: token}, for requests that return no logprobs. Whatever the logits, the
    masked target there gives that token probability 1, and every later processing step (
    temperature, penalties, top-k/p, the seeded draw) maps a one-hot row to the same one-hot:
    so the LM head need not compute these rows (grammar-forced drafts are such rows)."""
    if bitmask is None:
        return {}
    tokens = single_token_rows(bitmask).tolist()
    known = {}
    for request, start in zip(requests, row_starts):
        if request.grammar is None or request.sampling_params.logprobs is not None:
            continue
        for row in range(start, start + len(request.draft_token_ids) + 1):
            if tokens[row] >= 0:
                known[row] = tokens[row]
    return known


def single_token_rows(bitmask: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """Per row of a [rows, words] int32 bitmask, the one token it allows, or -1 (none or
    several): compiled on CPU, in torch where the extension is missing."""
    fused = cpu_ops_on(torch.device("cpu"), torch.float32)  # None where it did not build
    if fused is not None:
        return fused.single_token_rows(bitmask.contiguous())
    words = bitmask.to(torch.int64) & 0xFFFFFFFF  # each word unsigned
    one_word = (words != 0).sum(dim=1) == 1
    word = words.sum(dim=1)  # the nonzero word, where there is one
    one_bit = one_word & (word & (word - 1) == 0)
    index = (words != 0).to(torch.int64).argmax(dim=1)
    bit = torch.log2(word.clamp(min=1).double()).round().to(torch.int64)
    return torch.where(one_bit, index * 32 + bit, torch.full_like(word, -1))
