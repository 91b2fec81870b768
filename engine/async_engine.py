"""The engine behind an event loop: a background thread runs `step()`; callers await outputs.

The step loop owns the `LLMEngine` outright, from its construction on. Callers never touch it:
they post commands (add, abort) to a thread-safe queue, and outputs travel back through
engine/output_stream.py: at most one `loop.call_soon_threadsafe` per step and event loop, into
unbounded per-request lists, so the event loop never blocks on model work and the engine thread
never waits on a reader; a reader that falls behind takes what piled up merged into one output.

The thread that steps the model also builds it (load, weight packing, memory profile). OpenMP
gives each thread that runs parallel work its own team of workers, kept for the thread's life; two
teams on a small machine make libgomp stop spinning at its barriers, and every step then pays a
sleep and a wake-up per parallel region (measured: half the decode speed). One thread for all model
work means one team, and the served step runs as fast as `LLM.generate` on the main thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.core.device import release_freed_host_memory
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.output_stream import Mailbox, OutputStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop stopped; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """One request failed alone (its grammar, its logits, its text); the engine goes on."""


class AsyncEngine:
    def __init__(self, build_engine: Callable[[], LLMEngine], stream_interval: int = 1):
        """Starts the step thread, which calls `build_engine` and then steps what it returns;
        returns once the engine is built, raising what the build raised. `stream_interval`:
        steps whose outputs a stream gets at once (1: every step's; OutputStream.due)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.engine: LLMEngine | None = None
        self._build_error: BaseException | None = None
        self._built = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        # Written on the event loops' threads only (`generate`); the engine's reaches a mailbox
        # through its streams.
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stopped = threading.Event()
        self._step_started_at: float | None = None  # monotonic time; None between steps
        # Called on the engine thread before every step: fault injection for tests (a wedged
        # loop), nothing else.
        self.before_step: Callable[[], None] | None = None
        # Called once, on the engine thread, when a step fails in no one request's part and
        # the loop stops (the server then exits non-zero).
        self.on_dead: Callable[[BaseException], None] | None = None
        self.dead_error: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._build_and_run, args=(build_engine,),
                                        name="specserve-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(lambda: LLMEngine(config))

    # --------------------------------------------- what the server reads (its only door)
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def limits(self):
        """engine.config.EngineLimits: KV blocks, block size, context length."""
        return self.engine.limits

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def grammars(self):
        """The grammar compiler (thread-safe; the server compiles off the engine's thread)."""
        return self.engine.grammars

    def load(self) -> tuple[int, int, float]:
        """(running requests, waiting requests, share of KV blocks in use)."""
        scheduler = self.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting), self.engine.block_manager.usage

    def kv_blocks(self) -> tuple[int, int]:
        """(free or evictable KV blocks, all KV blocks)."""
        blocks = self.engine.block_manager
        return blocks.num_free_blocks, blocks.num_blocks

    def suffix_cache_stats(self):
        """The suffix proposer's global cache (a SuffixCacheStats), or None without one."""
        proposer = self.engine.proposer
        return proposer.cache_stats() if hasattr(proposer, "cache_stats") else None

    def is_idle(self) -> bool:
        """Nothing running, waiting or in flight, and every KV block free."""
        return not self.engine.has_unfinished() and self.engine.block_manager.usage == 0.0

    def add_stat_listener(self, listener) -> None:
        """Called on the engine's thread after every step and finished request (LLMEngine's)."""
        self.engine.add_stat_listener(listener)

    def validate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None, cache_salt: str = "") -> Request:
        """Tokenizes and checks a request against the engine's limits (ValueError with a message
        fit for an API client); `generate` takes what this returns, so a request is checked
        once."""
        return self.engine.make_request(prompt, params, request_id, cache_salt)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def step_seconds(self) -> float:
        """How long the step now running has run; 0 while the loop waits for work. A value that
        keeps growing means a wedged loop (liveness)."""
        started = self._step_started_at
        return 0.0 if started is None else time.monotonic() - started

    # -------------------------------------------------------------- public API
    async def generate(
        self, prompt: str | list[int] | Request, params: SamplingParams | None = None,
        request_id: str | None = None, *, final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yields incremental outputs until the request finishes; with `final_only`, just the
        first and the last (whose text, tokens and logprobs are cumulative). Leaving the loop
        early (a client disconnect, a cancelled task) aborts the request and frees its blocks."""
        if not self.is_running:
            raise self.dead_error or EngineDeadError("the engine loop is not running")
        if isinstance(prompt, Request):  # validated already (`validate`)
            request = prompt
            request.request_id = request_id or request.request_id
        else:
            request = self.validate(prompt, params, request_id or uuid.uuid4().hex)
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = Mailbox(loop)
        stream = OutputStream(loop, mailbox, final_only)
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        if not self.is_running:  # it died between the check above and the registration
            self._streams.pop(request.request_id, None)
            raise self.dead_error or EngineDeadError("the engine loop is not running")
        finished = False
        try:
            async for output in stream.outputs():
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Safe from any thread; takes effect before the engine's next step."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Aborts every request the engine holds now (the drain's deadline); each stream gets a
        final output with finish_reason "abort". Safe from any thread."""
        self._commands.put(("abort_all", None))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ engine thread
    def _build_and_run(self, build_engine: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = build_engine()
        except BaseException as error:  # handed to the constructor, which raises it
            self._build_error = error
            return
        finally:
            self._built.set()
        release_freed_host_memory()  # what loading freed, before serving
        if getattr(self.engine, "parallel", None) is not None:  # a dead rank wakes an idle loop
            self.engine.parallel.add_death_listener(lambda e: self._commands.put(("fail", e)))
        self._run()

    def _run(self) -> None:
        stepped = False  # since the engine was last idle
        while not self._stopped.is_set():
            idle = not self.engine.has_unfinished()
            if idle and stepped:
                # A burst has ended: what its temporaries freed goes back to the OS, once per
                # burst, while no step waits (0.2-8 ms). glibc keeps freed activation buffers
                # resident: 16 prompts of the default model left 58 MB of them on CPU.
                release_freed_host_memory()
                stepped = False
            try:
                self._apply_commands(block=idle)
                if self._stopped.is_set():
                    break
                self._step_started_at = time.monotonic()
                if self.before_step is not None:
                    self.before_step()
                outputs = self.engine.step()
                stepped = True
            except Exception as error:
                # No one request's fault (engine/failures.py): the engine's state can no longer
                # be trusted, so every request ends with an error and the loop stops.
                logger.exception("engine step failed outside any one request; the engine stops")
                self._die(error)
                return
            finally:
                self._step_started_at = None
            self._deliver([(output.request_id, output) for output in outputs])

    def _apply_commands(self, block: bool) -> None:
        command = self._commands.get() if block else self._next_command()
        replies: list[tuple[str, RequestOutput | BaseException]] = []
        while command is not None:
            kind, payload = command
            if kind == "add":
                self._add(payload, replies)
            elif kind == "abort":
                self._abort(payload, replies)
            elif kind == "abort_all":
                for request_id in self.engine.unfinished_request_ids():
                    self._abort(request_id, replies)
            elif kind == "fail":  # no one request's fault: the loop's handler stops the engine
                raise payload
            command = self._next_command()
        self._deliver(replies)

    def _abort(self, request_id: str, replies: list) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            replies.append((request_id, output))

    def _add(self, request: Request, replies: list) -> None:
        try:
            self.engine.add(request)
        except ValueError as error:
            replies.append((request.request_id, error))

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Posts `items` to their streams' event loops: one post per loop, whatever their
        number."""
        by_mailbox: dict[Mailbox, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, RequestOutput) and item.error is not None:
                item = RequestFailedError(item.error)
            due = stream.due(item, self.stream_interval)
            if due:
                by_mailbox.setdefault(stream.mailbox, []).extend((stream, d) for d in due)
        for mailbox, batch in by_mailbox.items():
            mailbox.post(batch)

    def _die(self, error: Exception) -> None:
        self.dead_error = EngineDeadError(f"the engine failed and stopped: "
                                          f"{type(error).__name__}: {error}")
        self._stopped.set()
        # queued adds included
        self._deliver([(request_id, self.dead_error) for request_id in list(self._streams)])
        if self.on_dead is not None:
            self.on_dead(error)
