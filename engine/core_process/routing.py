"""Where each output of the engine process goes in the API process: the stream of its request,
on that stream's event loop (engine/output_stream.py: one wake-up per loop and step).

Written by the event loops (`open`, `close`) and read by the client's I/O thread (`deliver`,
`fail_all`), under one lock; what is posted to a loop is posted after the lock is released.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass

from engine.async_engine import EngineDeadError, RequestFailedError
from engine.core.request import Request, RequestStatus
from engine.core_process import wire
from engine.output_stream import Mailbox, OutputStream
from engine.outputs import RequestOutput


@dataclass
class _Route:
    request: Request  # the front's copy: its prompt, and the engine's stamps once finished
    stream: OutputStream


class Routes:
    def __init__(self):
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._dead: EngineDeadError | None = None

    def open(self, request: Request, final_only: bool) -> OutputStream:
        """On the event loop that will read the stream. Raises the engine's death, if any."""
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = Mailbox(loop)
        stream = OutputStream(loop, mailbox, final_only)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._routes[request.request_id] = _Route(request, stream)
        return stream

    def close(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def deliver(self, step: wire.StepMessage) -> None:
        """A step's outputs (and refused adds) to their streams; with `final_only`, only the
        first and the last output of a request."""
        times = {t.request_id: t for t in step.finished}
        items = [(error.request_id, ValueError(error.message)) for error in step.errors]
        items += [(output.request_id, output) for output in step.outputs]
        batches: dict[Mailbox, list] = {}
        with self._lock:
            for request_id, item in items:
                route = self._routes.get(request_id)
                if route is None:
                    continue
                stream = route.stream
                if isinstance(item, RequestOutput):
                    if item.finished and request_id in times:
                        _copy_times(times[request_id], route.request)
                    if stream.final_only and stream.delivered and not item.finished:
                        continue
                    item.prompt_token_ids = route.request.prompt_token_ids
                    item.prompt = route.request.prompt_text
                    if item.error is not None:
                        item = RequestFailedError(item.error)
                stream.delivered = True
                batches.setdefault(stream.mailbox, []).append((stream, item))
        _post(batches)

    def fail_all(self, error: EngineDeadError) -> None:
        """Ends every open stream with `error`; later `open`s raise it."""
        with self._lock:
            self._dead = error
            routes = list(self._routes.values())
        batches: dict[Mailbox, list] = {}
        for route in routes:
            batches.setdefault(route.stream.mailbox, []).append((route.stream, error))
        _post(batches)


def _post(batches: dict[Mailbox, list]) -> None:
    for mailbox, batch in batches.items():
        mailbox.post(batch)


def _copy_times(times: wire.RequestTimes, request: Request) -> None:
    request.status = RequestStatus(times.status)
    request.first_scheduled_time = times.first_scheduled_time
    request.first_token_time = times.first_token_time
    request.last_token_time = times.last_token_time
    request.finished_time = times.finished_time
