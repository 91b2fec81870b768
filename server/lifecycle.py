"""Liveness, readiness and the graceful drain of one server process, as Kubernetes (or any load
balancer) asks about them.

- Liveness (`GET /health`): the engine has loaded, its loop thread runs, and no engine step has run
  longer than `--engine-step-timeout`. A draining replica is alive: draining never fails it.
- Readiness (`GET /ready`): live, warmed up (server/warm_up.py has run), not draining,
  fewer than `--max-queue` requests waiting for their first token, and no request waiting for a
  chat-template renderer (all of them taken: a template spinning until its time limit).
- Drain (the first SIGTERM or SIGINT): admission closes (503 `server_draining` with
  `Retry-After`) and `/ready` turns 503; responses in flight get `--drain-timeout` seconds to
  finish; what is left is aborted, so each stream ends with a chunk whose `finish_reason` is
  "abort", its usage if asked, and `[DONE]`. Once every response has closed and the engine holds no
  request and no KV block, uvicorn shuts down and the process exits 0. A second signal exits at
  once.
- Engine death (a step failed in no one request's part, out of memory included: see
  engine/failures.py): every request in flight has ended with an error, `/health` says
  `engine_dead`, and after `DEAD_EXIT_GRACE_S` (for those errors to reach their clients) uvicorn
  shuts down and the process exits 1, so an orchestrator restarts it. A watchdog exits 1 at
  `DEAD_EXIT_DEADLINE_S` whatever uvicorn is doing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi.responses import JSONResponse

from engine.metrics import first_use
from server.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    header_timeout_protocol,
    raise_file_limit,
)
from server.context import ServerContext, ServerSettings
from server.warm_up import warm_up

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after the deadline: for aborted streams to send their last events
IDLE_WAIT_S = 5.0  # for the engine to free the aborted requests' blocks
POLL_S = 0.05
DEAD_EXIT_GRACE_S = 1.0
DEAD_EXIT_DEADLINE_S = 8.0
DEAD_EXIT_STATUS = 1
WEDGE_ENV = "SPECSERVE_FAULT_WEDGE_ENGINE"  # tests only: "1" wedges the first step after warm-up
# The /metrics series the drain's last log line quotes: what a scrape would read just before exit.
FINAL_SERIES = ("num_requests_running", "num_requests_waiting", "num_requests_queued",
                "kv_cache_usage_perc", "kv_cache_free_blocks", "kv_cache_num_blocks")


@dataclass(frozen=True)
class Probe:
    status: str  # "ok", "draining" or why the probe fails: "loading", "engine_stalled", ...
    ok: bool = False

    def response(self) -> JSONResponse:
        return JSONResponse({"status": self.status}, status_code=200 if self.ok else 503)


class Lifecycle:
    """One per app. The lifespan calls `start` once the model has loaded; the signal handler
    calls `begin_drain`; `on_drained` tells the HTTP server to shut down."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.context: ServerContext | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.warmed_up = False
        self.draining = False
        self.on_drained: Callable[[], None] = lambda: None
        self.exit_status = 0  # what the process exits with once uvicorn has stopped
        self.render_metrics: Callable[[], bytes] | None = None  # the /metrics exposition
        self._drain_task: asyncio.Task | None = None

    async def start(self, context: ServerContext) -> None:
        """Runs the warm-up (server/warm_up.py: the chat template, the tokenizer and real
        requests through the engine, which pay every one-time cost), marks the ready moment from
        which first uses are counted (engine/metrics/first_use.py), then serves. On the event
        loop, before the first HTTP request."""
        self.context = context
        self.loop = asyncio.get_running_loop()
        context.engine.on_dead = self._engine_died
        first_use.count_kernel_compiles()
        await warm_up(context)
        first_use.ledger().mark_ready()
        self.warmed_up = True
        if os.environ.get(WEDGE_ENV) == "1":
            logger.warning("%s=1: the engine loop will wedge at its next step (a test)",
                           WEDGE_ENV)
            context.engine.before_step = threading.Event().wait

    def _engine_died(self, error: BaseException) -> None:
        """On the engine's thread, once."""
        logger.critical("the engine stopped (%s: %s); exiting with status %d in %.0f s",
                        type(error).__name__, error, DEAD_EXIT_STATUS, DEAD_EXIT_GRACE_S)
        self.exit_status = DEAD_EXIT_STATUS
        watchdog = threading.Timer(DEAD_EXIT_DEADLINE_S, _exit_now, args=(DEAD_EXIT_STATUS,))
        watchdog.daemon = True
        watchdog.start()
        self.loop.call_soon_threadsafe(self.loop.call_later, DEAD_EXIT_GRACE_S,
                                       lambda: self.on_drained())

    # ------------------------------------------------------------------ probes
    def liveness(self) -> Probe:
        context = self.context
        if context is None:
            return Probe("loading")
        if not context.engine.is_running:
            return Probe("engine_dead")
        if context.engine.step_seconds > self.settings.engine_step_timeout_s:
            return Probe("engine_stalled")
        return Probe("draining" if self.draining else "ok", ok=True)

    def readiness(self) -> Probe:
        live = self.liveness()
        if not live.ok:
            return live
        if self.draining:
            return Probe("draining")
        if not self.warmed_up:
            return Probe("warming_up")
        if self.context.admission.is_full:
            return Probe("queue_full")
        if self.context.templates is not None and self.context.templates.saturated:
            return Probe("chat_template_busy")
        return Probe("ok", ok=True)

    # ------------------------------------------------------------------- drain
    def begin_drain(self) -> None:
        """On the event loop; idempotent."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        context = self.context
        admission = context.admission
        self.draining = True
        admission.close()
        if context.templates is not None:  # a spinning rendering must not hold the drain up
            await context.templates.close()
        timeout = self.settings.drain_timeout_s
        logger.info("draining: %d responses in flight get up to %.0f s; a second SIGTERM or "
                    "SIGINT exits at once", len(admission.in_flight), timeout)
        started = time.monotonic()
        if not await _wait_until(lambda: not admission.in_flight, timeout):
            logger.warning("drain timeout: aborting %d responses still in flight",
                           len(admission.in_flight))
            # Repeated: a choice that waited for its prompt's first choice starts only now.
            await _wait_until(lambda: not admission.in_flight, ABORT_GRACE_S,
                              every=context.engine.abort_all)
        engine = context.engine
        idle = await _wait_until(engine.is_idle, IDLE_WAIT_S)
        (running, waiting, usage), (free_blocks, num_blocks) = engine.load(), engine.kv_blocks()
        logger.info("drained in %.1f s: %d responses open, %d requests running, %d waiting, "
                    "KV cache usage %.3f (%d of %d blocks free)%s",
                    time.monotonic() - started, len(admission.in_flight), running, waiting,
                    usage, free_blocks, num_blocks, "" if idle else "; NOT idle")
        if self.render_metrics is not None:
            logger.info("final /metrics: %s", "; ".join(_final_series(self.render_metrics())))
        self.on_drained()


def _final_series(exposition: bytes) -> list[str]:
    return [line for line in exposition.decode().splitlines() if not line.startswith("#")
            and line.split("{", 1)[0].rsplit(":", 1)[-1] in FINAL_SERIES]


async def _wait_until(done: Callable[[], bool], timeout_s: float,
                      every: Callable[[], None] | None = None) -> bool:
    """Polls `done` until it holds (True) or `timeout_s` passes (False), calling `every` first on
    each round."""
    deadline = time.monotonic() + timeout_s
    while True:
        if every is not None:
            every()
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the listening
    socket (so late requests get a 503 they can retry elsewhere, not a refused connection), and
    the second one exits at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self._signalled = False
        lifecycle.on_drained = self._drained

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: re-raising SIGTERM after a clean drain
        # would turn exit status 0 into death by signal.
        if self._signalled:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            _exit_now(128 + sig)
        self._signalled = True
        loop = self.lifecycle.loop
        if self.lifecycle.context is None or loop is None:
            self.should_exit = True  # still loading: nothing in flight to wait for
        else:
            loop.call_soon_threadsafe(self.lifecycle.begin_drain)

    def _drained(self) -> None:
        self.should_exit = True


def _exit_now(status: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(status)


def serve(app, lifecycle: Lifecycle, host: str, port: int, log_level: str,
          header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> None:
    raise_file_limit()
    # The drain has already waited for responses; uvicorn's own wait only covers the last bytes.
    # asyncio's loop even where uvloop is installed (uvicorn[standard] brings it): out of
    # descriptors, asyncio leaves new connections waiting in the backlog and retries a second
    # later (server/connections.py logs it), while libuv accepts and closes them at once, so a
    # health probe during a flood of idle sockets was dropped (seen on a GPU machine).
    # ws="none": no route speaks WebSocket, and uvicorn's default imports the websockets package.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio",
                            timeout_graceful_shutdown=ABORT_GRACE_S, ws="none",
                            http=header_timeout_protocol(header_timeout_s))
    DrainingServer(config, lifecycle).run()
    if lifecycle.exit_status:
        _exit_now(lifecycle.exit_status)
