"""Connections bounded in time and number, for a server with nothing in front of it.

uvicorn closes a connection idle between keep-alive requests (`timeout_keep_alive`), but not one
that never finishes its request headers: a socket that connects and sends nothing, or sends a
header line every few seconds, is held forever, and some thousands of them use up the process's
file descriptors. `HeaderTimeoutProtocol` closes those after `header_timeout_s`. At start the soft
descriptor limit is raised to the hard one, and the event loop's accept errors (one per attempt
while descriptors run out) are logged once per interval with a count.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    `header_timeout_s` after it opened or after its previous response."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderTimeoutProtocol


def raise_file_limit() -> None:
    """Soft descriptor limit up to the hard one: each connection holds one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            logger.warning("could not raise the file descriptor limit from %d to %d: %s",
                           soft, hard, error)
            return
    logger.info("file descriptors: soft limit %d (was %d), hard limit %d",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0], soft, hard)


class AcceptErrorLog:
    """An event loop exception handler that logs accept failures once per interval, counted;
    everything else goes to the loop's default handler."""

    def __init__(self, interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.count = 0
        self._last = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if "_start_serving" in repr(context.get("handle")) and \
                isinstance(context.get("exception"), ValueError):
            # asyncio retries accepting a second after running out of descriptors, even when
            # the listening socket has closed since (at shutdown): nothing is lost.
            logger.debug("accept retry after the listening socket closed: %s", context)
            return
        if "accept" not in context.get("message", ""):
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            logger.error("%s (%d accept errors so far: %s); connections wait until "
                         "descriptors free up", context["message"], self.count,
                         context.get("exception"))
            self._last = now
