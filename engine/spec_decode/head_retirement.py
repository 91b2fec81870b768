"""When a request's draft head retires: it has not paid for HEAD_IDLE_STEPS decode steps.

A request keeps the target's rows for its EAGLE head (eagle.py), and while any request in a step
does, the target's forward returns its feature layers too (the compiled stack run in segments).
That costs ~1-2% of every step (AMD EPYC Zen 4, benchmarks/experiments/method_overhead.py) and is
wasted where the head does not draft: its drafts keep failing (the controller then drafts with it
only to probe, every 32 steps), or the controller does not draft at all (verified rows cost too
much, as at 16 requests on a CPU). So, where the controller adapts K, a step counts against the
head when the request's drafts added nothing to it, and an accepted head draft starts the count
again; a step where another source's drafts were accepted (EAGLE's copy lookup, `auto`'s suffix
and n-gram lookups, a grammar's forced tokens) counts neither way, since the head may be wanted
when that source runs out. A good head is accepted within a few steps (the acceptance tracker's
memory is ~20 trials). A retired head does not come back: it reads its own KV at every earlier
position, which the positions after retiring would lack.
"""

from __future__ import annotations

from engine.core.request import Request

HEAD_IDLE_STEPS = 32
# The head's acceptance tracker in `request.acceptance_by_source` (eagle.py and auto.py's key):
# dropped with the head, so the scheduler reserves no slots for its drafts.
HEAD_TRACKER = "eagle"


def count_step(request: Request, head_drafted: bool, accepted: bool) -> None:
    """After a decode step of a request whose head is live: `head_drafted`, the step's drafts
    were the head's; `accepted`, some draft was accepted. Retires the head after more than
    HEAD_IDLE_STEPS steps that added nothing (`request.head_retired`, its rows and its tracker
    dropped)."""
    if accepted:
        if head_drafted:
            request.head_idle_steps = 0
        return
    request.head_idle_steps += 1
    if request.head_idle_steps > HEAD_IDLE_STEPS:
        request.head_retired = True
        request.pending_features = []
        request.acceptance_by_source.pop(HEAD_TRACKER, None)
