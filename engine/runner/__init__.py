"""Step runners: flat and padded (CUDA-graph) steps behind one interface, and overlapped steps.

Both runners take a step the same way: `prepare(scheduled)` builds its inputs (ModelInput or
StaticStep: the same logits bookkeeping), `run(prepared, known_next_tokens)` returns (hidden
states, logits), and `row_cost(num_seqs)` says what a step's rows cost a proposer (None: the
flat step's rows, one per fed token). `runner_for` picks the one a step runs on.
"""

from __future__ import annotations


def runner_for(scheduled, flat, padded):
    """The padded runner where the engine has one and the step fits its layout (decode and
    verify steps within the lookahead it was sized for), else the flat one."""
    return padded if padded is not None and padded.fits(scheduled) else flat
