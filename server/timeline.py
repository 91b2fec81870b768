"""A served request's timeline, the server's part: the stamps only the front can take.

The engine stamps what it sees on the engine `Request` (first scheduled, first and last token
sampled, finished: engine/core/request.py). The server stamps, on the same object, when the
request reached its route, when its chat template was rendered, when it was tokenized and when it
was handed to the engine (`FrontClock`), and, once its response is written, when the bytes of its
first and last token reached the socket (`WriteClock`). Every stamp is `time.monotonic()`.

Turning stamps into spans and spans into histograms happens in one place each:
engine/metrics/stats.py (`request_stats`, `delivery_stats`) and engine/metrics/prometheus.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.metrics.stats import delivery_stats
from server.context import ServerContext


# Where the outermost middleware (server/metrics.py) leaves the time a request came in, in its
# ASGI scope: before the other middleware, the routing and the body's reading.
ARRIVAL_SCOPE_KEY = "specserve.arrival"


def stamp_arrival(scope: dict) -> None:
    scope[ARRIVAL_SCOPE_KEY] = time.monotonic()


@dataclass
class FrontClock:
    """The stamps taken before the engine `Request` exists."""

    arrival: float = field(default_factory=time.monotonic)
    rendered: float | None = None  # chat template rendered (chat routes only)
    tokenized: float | None = None

    @classmethod
    def since_arrival(cls, scope: dict) -> FrontClock:
        """A clock from the request's arrival (`stamp_arrival`), or from now without one."""
        arrival = scope.get(ARRIVAL_SCOPE_KEY)
        return cls() if arrival is None else cls(arrival)

    def mark_rendered(self) -> None:
        self.rendered = time.monotonic()

    def mark_tokenized(self) -> None:
        self.tokenized = time.monotonic()

    def hand_over(self, choices) -> None:
        """Writes the front's stamps on each choice's engine request, the last of them (queued)
        now: call right before the requests go to the engine."""
        queued = time.monotonic()
        for choice in choices:
            request = choice.request
            request.arrival_time = self.arrival
            request.rendered_time = self.rendered
            request.tokenized_time = self.tokenized
            request.queued_time = queued


class WriteClock:
    """When each choice's first and last token reached its client's socket.

    A streamed response's generator is resumed only once the event it yielded has been sent
    (Starlette's StreamingResponse awaits the send before asking for the next event), so the time
    at which a `yield` returns is the time that event's bytes were written."""

    def __init__(self, context: ServerContext, choices):
        self._context = context
        self._requests = {choice.index: choice.request for choice in choices}
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._unwritten: set[int] = set()  # choices with tokens sampled but not yet written
        self._observed = False

    def tokens_ready(self, index: int, output) -> None:
        """`output` (an engine RequestOutput of choice `index`) is about to be written."""
        if output.delta_token_ids:
            self._unwritten.add(index)

    def written(self, index: int) -> None:
        """An event of choice `index` has just been written."""
        if index in self._unwritten:
            self._unwritten.discard(index)
            now = time.monotonic()
            self._first.setdefault(index, now)
            self._last[index] = now

    def written_whole_and_observe(self) -> None:
        """For a response that is not streamed, once its body has been sent: the choices whose
        engine requests ended normally were written, every token at once (one that was aborted,
        its client gone, was not)."""
        now = time.monotonic()
        finished = {index for index, request in self._requests.items()
                    if request.status.value in ("stop", "length")}
        for index in finished:
            self._first[index] = self._last[index] = now
        self.observe(finished)

    def observe(self, finished: set[int]) -> None:
        """Records each choice once; the last token's write only for the choices in `finished`
        (their final output was written)."""
        if self._observed:
            return
        self._observed = True
        server_metrics = self._context.server_metrics
        if server_metrics is None or server_metrics.engine_metrics is None:
            return
        for index, request in self._requests.items():
            last = self._last.get(index) if index in finished else None
            server_metrics.engine_metrics.on_request_delivered(
                delivery_stats(request, self._first.get(index), last))
