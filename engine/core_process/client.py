"""The engine in its own process, behind the same face as `AsyncEngine` (engine/async_engine.py),
so the server runs unchanged on either.

The engine process (worker.py) owns the `LLMEngine`: scheduling, the model, speculation and the
detokenizer. This process owns HTTP, templates and tokenizing, with its own copy of the tokenizer
and of the request checks (front.py). Commands go out on a ZeroMQ PUSH socket; one message per
engine step comes back on a PULL socket, read by one I/O thread that hands each step's outputs to
the event loops (engine/output_stream.py: one wake-up per loop and step) and calls the stat
listeners (Prometheus, the log line) here, as the engine thread calls them in the in-thread mode.

Death: the I/O thread also waits on the engine process's sentinel, so a killed process is seen at
once, not as a reply that never comes. Every request in flight then ends with `EngineDeadError`
and `on_dead` is called (the server answers 503 and exits non-zero: server/lifecycle.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import zmq

from engine.async_engine import EngineDeadError
from engine.config import EngineConfig
from engine.core.request import Request
from engine.core_process import wire
from engine.core_process.front import FrontValidator, load_tokenizer
from engine.core_process.gauges import SharedGauges
from engine.core_process.routing import Routes
from engine.core_process.worker import run_engine_core
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCoreClient:
    def __init__(self, config: EngineConfig):
        """Starts the engine process ('spawn': safe with CUDA) and returns once it has built the
        engine, raising what the build raised (a ValueError as itself)."""
        self.config = config
        self._before_step: Callable[[], None] | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        self.dead_error: EngineDeadError | None = None
        self._stopping = False
        self._routes = Routes()
        self._listeners: list = []
        self._suffix_cache = None
        self._encoder, self._decoder = wire.Encoder(), wire.event_decoder()
        self._folder = tempfile.TemporaryDirectory(prefix="specserve-engine-")
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # queue what the engine has not read yet
        self._commands_lock = threading.Lock()  # a socket is not thread-safe; callers are many
        self._events = self._zmq.socket(zmq.PULL)
        commands_address = f"ipc://{self._folder.name}/commands"
        events_address = f"ipc://{self._folder.name}/events"
        self._commands.bind(commands_address)
        self._events.bind(events_address)
        spawn = multiprocessing.get_context("spawn")
        self._gauges = SharedGauges(spawn)
        self._process = spawn.Process(target=run_engine_core, name="specserve-engine-core",
                                      args=(config, commands_address, events_address,
                                            self._gauges, logging.getLogger().level),
                                      daemon=True)
        self._process.start()
        ready = self._wait_ready()
        self.engine_pid = ready.pid
        self.model_name = ready.model_name
        self.vocab_size = ready.vocab_size
        self._front = FrontValidator(config, ready, load_tokenizer(ready))
        self._has_suffix_cache = ready.has_suffix_cache
        self._io = threading.Thread(target=self._read_events, name="specserve-engine-io",
                                    daemon=True)
        self._io.start()
        logger.info("engine core in process %d", ready.pid)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "EngineCoreClient":
        return cls(config)

    def _events_or_death(self) -> zmq.Poller:
        """Polls the engine's events and its process's sentinel together: a death is seen
        even when no message announces it."""
        poller = zmq.Poller()
        poller.register(self._events, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        return poller

    def _wait_ready(self) -> wire.Ready:
        poller = self._events_or_death()
        while True:
            ready = dict(poller.poll())
            if self._events in ready:
                event = self._decoder.decode(self._events.recv())
                if isinstance(event, wire.Ready):
                    return event
                self._close_sockets()
                self._process.join()
                error = ValueError if event.error_type == "ValueError" else RuntimeError
                raise error(event.message)
            if self._process.sentinel in ready:
                self._close_sockets()
                raise RuntimeError(f"the engine process exited with status "
                                   f"{self._process.exitcode} while starting")

    # --------------------------------------------- what the server reads (its only door)
    @property
    def tokenizer(self):
        return self._front.tokenizer

    @property
    def limits(self):
        """engine.config.EngineLimits: KV blocks, block size, context length."""
        return self._front.limits

    @property
    def grammars(self):
        """This process's grammar compiler (the server compiles off its event loop)."""
        return self._front.grammars

    def load(self) -> tuple[int, int, float]:
        """(running requests, waiting requests, share of KV blocks in use)."""
        return self._gauges.load()

    def kv_blocks(self) -> tuple[int, int]:
        """(free or evictable KV blocks, all KV blocks)."""
        return self._gauges.kv_blocks()

    def suffix_cache_stats(self):
        """The suffix proposer's global cache as of the last step, or None without one."""
        if not self._has_suffix_cache:
            return None
        return self._suffix_cache or wire.SuffixCacheStats()

    def is_idle(self) -> bool:
        """Nothing running, waiting or in flight, and every KV block free."""
        return self._gauges.is_idle()

    def add_stat_listener(self, listener) -> None:
        """Called on this process's I/O thread with each step's and finished request's stats."""
        self._listeners.append(listener)

    def validate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None, cache_salt: str = "") -> Request:
        """Tokenizes and checks a request as the engine will (ValueError with a message fit for
        an API client); `generate` takes what this returns."""
        return self._front.make_request(prompt, params, request_id, cache_salt)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopping and self._process.is_alive()

    @property
    def step_seconds(self) -> float:
        """How long the engine's current step has run; 0 between steps."""
        started = self._gauges.step_started_at
        return 0.0 if started is None else max(time.monotonic() - started, 0.0)

    @property
    def before_step(self):
        return self._before_step

    @before_step.setter
    def before_step(self, function: Callable[[], None] | None) -> None:
        """Runs in the engine process before each step (fault injection for tests): it must be
        picklable (pickle.PicklingError otherwise)."""
        pickled = pickle.dumps(function) if function is not None else b""
        self._before_step = function
        self._send(wire.SetBeforeStep(pickled))

    # -------------------------------------------------------------- public API
    async def generate(
        self, prompt: str | list[int] | Request, params: SamplingParams | None = None,
        request_id: str | None = None, *, final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.generate`: incremental outputs until the request finishes (with
        `final_only`, the first and the last); leaving early aborts the request."""
        if not self.is_running:
            raise self.dead_error or EngineDeadError("the engine process is not running")
        if isinstance(prompt, Request):
            request = prompt
            request.request_id = request_id or request.request_id
        else:
            request = self.validate(prompt, params, request_id or uuid.uuid4().hex)
        stream = self._routes.open(request, final_only)
        self._send(_add_message(request))
        finished = False
        try:
            async for output in stream.outputs():
                finished = output.finished
                yield output
        finally:
            self._routes.close(request.request_id)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Safe from any thread; takes effect before the engine's next step."""
        self._send(wire.Abort(request_id))

    def abort_all(self) -> None:
        """Aborts every request the engine holds now; each stream gets a final output with
        finish_reason "abort". Safe from any thread."""
        self._send(wire.AbortAll())

    def shutdown(self) -> None:
        self._stopping = True
        self._send(wire.Stop())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._io.join(timeout=5)
        self._close_sockets()

    def _send(self, command: wire.Command) -> None:
        if self._stopping and not isinstance(command, wire.Stop):
            return
        data = self._encoder.encode(command)
        with self._commands_lock:
            if self._commands.closed:
                return
            try:  # never blocks the caller (an event loop): a PUSH with no peer would
                self._commands.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no engine process to take it: it has died (or is dying)
                logger.warning("engine process gone: %s not delivered", type(command).__name__)

    def _close_sockets(self) -> None:
        with self._commands_lock:
            self._zmq.destroy(linger=0)
        self._folder.cleanup()

    # -------------------------------------------------------------- I/O thread
    def _read_events(self) -> None:
        poller = self._events_or_death()
        while True:
            ready = dict(poller.poll())
            if self._events in ready:
                while self._events.poll(0):  # everything sent before a death, first
                    if not self._on_event(self._decoder.decode(self._events.recv())):
                        return
            elif self._process.sentinel in ready:
                if not self._stopping:
                    self._process.join(timeout=1)  # for its exit code
                    self._die(f"the engine process exited with status "
                              f"{self._process.exitcode}")
                return

    def _on_event(self, event) -> bool:
        """False once the engine has said it is dead."""
        if isinstance(event, wire.Dead):
            self._die(f"the engine failed and stopped: {event.message}")
            return False
        self._routes.deliver(event)
        for stats in event.step_stats:
            for listener in self._listeners:
                listener.on_step(stats)
        for stats in event.request_stats:
            for listener in self._listeners:
                listener.on_request_finished(stats)
        if event.suffix_cache is not None:
            self._suffix_cache = event.suffix_cache
        return True

    def _die(self, reason: str) -> None:
        logger.critical("%s", reason)
        self.dead_error = EngineDeadError(reason)
        self._routes.fail_all(self.dead_error)
        if self.on_dead is not None:
            self.on_dead(self.dead_error)


def _add_message(request: Request) -> wire.AddRequest:
    return wire.AddRequest(
        request.request_id, request.prompt_token_ids, request.sampling_params,
        request.prompt_text, request.cache_salt, request.arrival_time, request.rendered_time,
        request.tokenized_time, request.queued_time)
