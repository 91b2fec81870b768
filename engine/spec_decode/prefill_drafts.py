"""Drafts at prefill: a prompt's last chunk also verifies guesses at the answer's first tokens.

Without it, a request's first draft goes out one step after its prompt: the prefill yields one
token, and only the next step verifies what the proposer guessed from the prompt. Agent loops
and repeated prompts send prompts whose answer is already in the prompt or in an earlier
output, and there a whole answer is often 2-4 verify steps, one of them spent on that single
token. Here the prompt's last chunk carries the drafts after its own tokens, and the step's
logits rows are its last prompt row and the draft rows: one step fewer per request.

Lossless only where a draft row's logits in a prefill chunk are bitwise what the same row
computes in a decode step: the CPU's float32 path, whose matmuls and paged attention compute a
row from that row alone at any row count (a chunk's rows go through the same attention kernel,
row by row: engine/attention/torch_backend.py). On CUDA a chunk's attention runs through SDPA,
whose reduction order follows the query's shape, so there it is off.
"""

from __future__ import annotations

import torch

from engine.quant.kernels import cpu_ops_on


def chunks_are_row_invariant(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a prefill chunk's rows compute what decode rows compute, bit for bit: where the
    CPU kernels apply (without a compiler they do not build, and the torch path's SDPA takes
    the chunk)."""
    return cpu_ops_on(device, dtype) is not None


def drafts_at_prefill(requested: bool | None, proposer, device: torch.device,
                      dtype: torch.dtype) -> bool:
    """Whether prompts' last chunks carry drafts. `requested` None: wherever it is lossless
    and the proposer guesses from tokens alone; True where it cannot be is refused."""
    if requested is False:
        return False
    why_not = None
    if proposer is None:
        why_not = "there is no speculation (--speculative-method none)"
    elif not proposer.drafts_at_prefill:
        why_not = (f"--speculative-method {proposer.name} drafts only after the prompt's own "
                   "step (use ngram or suffix)")
    elif not chunks_are_row_invariant(device, dtype):
        why_not = (f"on {device.type} in {str(dtype).removeprefix('torch.')} a prompt chunk's "
                   "rows are not computed as decode rows are, so its drafts would change the "
                   "output (CPU float32 only)")
    if why_not is not None and requested:
        raise ValueError(f"--draft-at-prefill: {why_not}")
    return why_not is None
