"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n`
last. An error after the stream started (the status line is gone) is sent as an event carrying
OpenAI's error envelope, and the stream ends there: no `[DONE]`, which would claim success."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextvars import ContextVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.async_engine import EngineDeadError, RequestFailedError
from server.errors import SERVER_ERROR, APIError, from_value_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# Set in the request's own task when its stream was aborted for a stalled client; uvicorn reads
# the app's return in that same task.
_stalled: ContextVar[bool] = ContextVar("stream_stalled", default=False)


class StalledStreamFilter(logging.Filter):
    """uvicorn closes the connection of a response that did not complete, which is what a stall
    abort wants, and logs it as an error; for a stall that was already logged, the line is
    dropped. Any other incomplete response still logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_stalled.get() and record.getMessage().startswith(
            "ASGI callable returned without completing response"))


logging.getLogger("uvicorn.error").addFilter(StalledStreamFilter())


def event(chunk: BaseModel, with_usage: bool = True) -> str:
    """One chunk; without `with_usage` the `usage` field is left out entirely (OpenAI sends it,
    null until the last chunk, only when the client asked for usage)."""
    payload = chunk.model_dump_json(exclude=None if with_usage else {"usage"})
    return f"data: {payload}\n\n"


def stream_error(error: Exception) -> APIError:
    """What a stream that fails after it started tells its client (chat, completions and the
    Responses API alike)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return from_value_error(error)
    if isinstance(error, RequestFailedError):  # logged by the engine
        return APIError(500, f"the request failed: {error}", SERVER_ERROR, code="request_failed")
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), SERVER_ERROR, code="engine_dead")
    logger.exception("stream failed", exc_info=error)
    return APIError(500, str(error), SERVER_ERROR)


def error_event(error: Exception) -> str:
    return f"data: {json.dumps(stream_error(error).body())}\n\n"


class StallWatch:
    """Wraps a stream's `send`: a send that has not finished `timeout_s` after it started raises
    TimeoutError in the sending task, as `asyncio.timeout` around each send would, without a
    timer made and cancelled per chunk. One timer runs per stream: when it fires it checks the
    send in flight, re-arms itself for that send's own deadline, or stops until the next send."""

    def __init__(self, send: Send, timeout_s: float | None):
        self._send = send
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._started: float | None = None  # when the send in flight started; None: no send
        self._sender: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def send(self, message) -> None:
        if self._timeout_s is None:
            await self._send(message)
            return
        self._started = started = self._loop.time()
        self._sender = asyncio.current_task()
        if self._timer is None:
            self._timer = self._loop.call_at(started + self._timeout_s, self._check)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            # Only this watch's cancel becomes a timeout; a disconnect's cancel stays one.
            if self._fired and self._sender.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self._started = None

    def _check(self) -> None:
        self._timer = None
        if self._started is None:
            return  # between sends: the next send arms the timer again
        deadline = self._started + self._timeout_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check)
            return
        # The sender is suspended inside this send (only it sets `_started`), so the cancel
        # lands there.
        self._fired = True
        self._sender.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class EventStreamResponse(StreamingResponse):
    """A streaming response that always closes its event generator and calls `on_close`, so a
    client that disconnects between chunks aborts its engine requests at once, not whenever the
    abandoned generator is garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None],
                 on_close: Callable[[], Awaitable[None]], stall_timeout_s: float | None = None):
        """`stall_timeout_s`: a client that reads nothing for this long (its socket buffers
        full, so a send cannot finish) has its stream aborted."""
        super().__init__(events, headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close  # also runs when the generator never started
        self._stall_timeout_s = stall_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = StallWatch(send, self._stall_timeout_s)
        try:
            await super().__call__(scope, receive, watch.send)
        except TimeoutError:
            _stalled.set(True)
            logger.info("stream aborted: its client read nothing for %g s",
                        self._stall_timeout_s)
        finally:
            watch.close()
            await self._events.aclose()
            await self._on_close()
