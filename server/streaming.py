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
        async def send_unless_stalled(message) -> None:
            async with asyncio.timeout(self._stall_timeout_s):
                await send(message)

        try:
            await super().__call__(scope, receive, send_unless_stalled)
        except TimeoutError:
            _stalled.set(True)
            logger.info("stream aborted: its client read nothing for %g s",
                        self._stall_timeout_s)
        finally:
            await self._events.aclose()
            await self._on_close()
