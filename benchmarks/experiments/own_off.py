"""One engine against itself with its speculation switched off: `method_overhead --own-off`.

Twins of `none` differ by where their memory landed, not by what they do: on an Intel Xeon
(Emerald Rapids, 2 vCPUs, 260 MB L3 shared with other tenants) a second `none` engine read 0.82x
the first in all 7 of its runs, and over five processes twins spread 0.46-1.22x, wider than the
5% issue 49 asks to resolve. Switched off, a speculative engine steps as `none`'s does on the
same weights, caches and buffers; what is left between its two kinds of run is the method and
the machine's noise over time, whose floor `none` run twice in the same turns shows.
"""

from __future__ import annotations

import contextlib
import statistics

from specserve.bench.report import taking_turns


@contextlib.contextmanager
def speculation_off(llm):
    """An `engine.LLM` steps as a `none` engine does while inside: no lookahead slots, no proposer,
    no feature rows, no drafts at the prompt's step. Not for overlapped engines (their quiet
    steps read the speculation)."""
    engine = llm.engine
    if engine.overlap is not None:
        raise SystemExit("--own-off measures engines without --async-scheduling")
    speculation, at_prefill = engine.speculation, engine.scheduler.draft_at_prefill
    engine.speculation, engine.scheduler.draft_at_prefill = None, False
    try:
        yield
    finally:
        engine.speculation, engine.scheduler.draft_at_prefill = speculation, at_prefill


def turn_order(groups: list[list[str]], repeat: int) -> list[str]:
    """The order of the `repeat`-th turn: the groups rotated (taking_turns), each group's
    runs side by side, first one of them and then the other first. A run that follows another
    engine's may start colder than one that follows its own engine's; alternating who goes first
    in a group keeps that out of the ratios between its runs."""
    return [m for group in taking_turns(groups, repeat)
            for m in (group if repeat % 2 == 0 else group[::-1])]


def against_own_off(on: list, off: list, reference) -> dict:
    """An engine's runs against its runs with speculation off: the medians' ratio, each run's
    against the one beside it (the machine's slow drifts cancel), and the fastest's (what is left
    where the noise only ever adds time); and whether the off runs kept `none`'s tokens."""
    on_seconds, off_seconds = [r[0] for r in on], [r[0] for r in off]
    return {
        "ratio_vs_own_off": round(statistics.median(off_seconds)
                                  / statistics.median(on_seconds), 3),
        "paired_ratio_vs_own_off": round(statistics.median(
            o / r for o, r in zip(off_seconds, on_seconds)), 3),
        "fastest_ratio_vs_own_off": round(min(off_seconds) / min(on_seconds), 3),
        "own_off_same_tokens_as_none": all(out == reference for _, _, out in off)}
