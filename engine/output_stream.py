"""A request's outputs on their way from the engine's thread to a reader on an event loop.

The engine thread posts a whole step's outputs to each event loop's `Mailbox`, which wakes its
loop with one `loop.call_soon_threadsafe`: at most one wake-up of the loop per step, not one per
request (at 64 streams a wake-up each cost the loop, and the GIL it shares with the step, 64
turns), and none while the loop has not yet taken the last: what later steps post joins it.

Each stream keeps what its reader has not taken in an unbounded list, so the engine thread never
waits on a reader. A reader that falls behind (a slow client, a loop that turns slower than the
engine steps) takes everything that piled up merged into one output (vLLM's `stream_interval`,
by demand). The merge is exact: the deltas concatenate, and the cumulative fields (text, final
token ids, finish reason, logprobs, counters) are the last output's, so a client sees the same
text, token ids and logprobs either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from engine.outputs import RequestOutput


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One output equal to `outputs` (consecutive, of one request, oldest first) read in turn.
    Raises ValueError for an empty list."""
    if not outputs:
        raise ValueError("no outputs to merge")
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprob_parts = [o.delta_logprobs for o in outputs if o.delta_logprobs is not None]
    return dataclasses.replace(
        last,
        delta_text="".join(o.delta_text for o in outputs),
        delta_token_ids=[token for o in outputs for token in o.delta_token_ids],
        delta_logprobs=[lp for part in logprob_parts for lp in part] if logprob_parts else None,
    )


@dataclass
class OutputStream:
    """One request's outputs for one reader. `pending` is written on the event loop only
    (`hand_over`), so it needs no lock."""

    loop: asyncio.AbstractEventLoop
    mailbox: "Mailbox"  # its loop's
    # Deliver only the first output (the prompt is done) and the last: each delivery wakes the
    # event loop, whose Python then competes with the step thread's for the GIL (vLLM's
    # RequestOutputKind.FINAL_ONLY); the last output carries the whole text.
    final_only: bool = False
    delivered: bool = False  # written by the engine thread only
    held: list = field(default_factory=list)  # the engine thread's: outputs kept back
    # Outputs not taken yet, then at most one exception, which ends the stream.
    pending: list = field(default_factory=list)
    waiter: asyncio.Future | None = None  # the reader's, while it waits

    def due(self, item: RequestOutput | BaseException, stream_interval: int) -> list:
        """On the engine thread: what to post now, `item` given (oldest first). `final_only`
        drops the outputs between the first and the last; with `stream_interval` N, a stream
        is posted every N steps (its first output and its last at once, and an exception with
        what was held before it), as vLLM's `--stream-interval` sends N tokens a chunk."""
        if isinstance(item, RequestOutput) and not item.finished and self.delivered:
            if self.final_only:
                return []
            if len(self.held) + 1 < stream_interval:
                self.held.append(item)
                return []
        self.delivered = True
        due, self.held = [*self.held, item], []
        return due

    async def take(self) -> tuple[RequestOutput | None, BaseException | None]:
        """Waits for anything, then empties the stream: (its outputs merged, or None; the
        exception that ended it, or None)."""
        if not self.pending:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.pending = self.pending, []
        for position, item in enumerate(items):
            if isinstance(item, BaseException):  # nothing follows one
                return (merge_outputs(items[:position]) if position else None), item
        return merge_outputs(items), None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The stream's outputs in turn (pending ones merged) until the last; raises the
        exception that ended the stream, after the outputs that came before it."""
        while True:
            output, error = await self.take()
            if output is not None:
                yield output
            if error is not None:
                raise error
            if output is not None and output.finished:
                return


def hand_over(batch: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    """On the event loop: appends each item to its stream and wakes a reader that waits."""
    for stream, item in batch:
        stream.pending.append(item)
        if stream.waiter is not None and not stream.waiter.done():
            stream.waiter.set_result(None)


class Mailbox:
    """What the engine thread has posted to one event loop and the loop has not yet taken."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[OutputStream, RequestOutput | BaseException]] = []
        self._wake_pending = False

    def post(self, items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
        """From the engine thread: never waits on the loop; wakes it only where no wake-up is
        pending already."""
        with self._lock:
            self._items.extend(items)
            if self._wake_pending:
                return
            self._wake_pending = True
        self.loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._wake_pending = False
        hand_over(items)
