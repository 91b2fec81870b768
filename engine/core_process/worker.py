"""The engine process: builds the `LLMEngine` and steps it, talking to the front over two ZeroMQ
sockets (commands in, one message per step out).

It never waits on a client: commands are read without blocking between steps, and outputs are
pushed (a ZeroMQ queue), not handed over. A grammar is compiled on a worker thread of this
process and its request joins the batch once compiled, so a slow grammar delays only itself.
The gauges the front reads at any time (step start, load, KV blocks) live in shared memory
(`SharedGauges`), written here after every step and command.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from engine.core_process import wire
from engine.core_process.gauges import SharedGauges

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # an idle engine wakes this often to see whether the front still lives
COMPILE_POLL_MS = 2  # while grammars compile: how soon a compiled request joins


class _StatCollector:
    """The engine's stat listener here: keeps the stats until the step's message carries them
    to the front's listeners."""

    def __init__(self):
        self.steps, self.requests = [], []

    def on_step(self, stats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats) -> None:
        self.requests.append(stats)

    def take(self) -> tuple[list, list]:
        steps, requests, self.steps, self.requests = self.steps, self.requests, [], []
        return steps, requests


class EngineCore:
    """The step loop of the engine process."""

    def __init__(self, engine, commands: zmq.Socket, events: zmq.Socket, gauges: SharedGauges):
        self.engine = engine
        self.commands, self.events, self.gauges = commands, events, gauges
        self.encoder, self.decoder = wire.Encoder(), wire.command_decoder()
        self.stats = _StatCollector()
        engine.add_stat_listener(self.stats)
        self.requests = {}  # request id -> Request, until finished (its stamps go back)
        self.compiling: list[tuple[Future, wire.AddRequest]] = []
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        self.before_step = None
        self.stopped = False
        self.parent = multiprocessing.parent_process()
        self._last_parent_check = time.monotonic()
        self._publish_gauges()  # the KV pool's size, before the first step

    def run(self) -> None:
        from engine.core.device import release_freed_host_memory

        stepped = False
        while not self.stopped:
            idle = not self.engine.has_unfinished()
            if idle and stepped:  # a burst has ended (see engine/async_engine.py)
                release_freed_host_memory()
                stepped = False
            self._check_parent()
            parallel = getattr(self.engine, "parallel", None)
            if parallel is not None:  # a dead tensor-parallel rank: raise, the caller exits 1
                parallel.check()
            message = wire.StepMessage()
            timeout = (COMPILE_POLL_MS if self.compiling else IDLE_POLL_MS) if idle else 0
            self._apply_commands(message, timeout)
            self._join_compiled(message)
            if self.stopped:
                break
            if self.engine.has_unfinished():
                self.gauges.step_started(time.monotonic())
                if self.before_step is not None:
                    self.before_step()
                outputs = self.engine.step()  # raising: the caller reports and exits
                self.gauges.step_started(None)
                message.outputs.extend(outputs)
                stepped = True
            self._send(message)

    # ----------------------------------------------------------------- commands
    def _apply_commands(self, message: wire.StepMessage, timeout_ms: int) -> None:
        if timeout_ms and not self.commands.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            command = self.decoder.decode(raw)
            if isinstance(command, wire.AddRequest):
                self._add(command, message)
            elif isinstance(command, wire.Abort):
                self._abort(command.request_id, message)
            elif isinstance(command, wire.AbortAll):
                for request_id in self.engine.unfinished_request_ids():
                    self._abort(request_id, message)
                for _, add in self.compiling:
                    message.outputs.append(_aborted(add.request_id))
                self.compiling.clear()
            elif isinstance(command, wire.SetBeforeStep):
                self.before_step = pickle.loads(command.pickled) if command.pickled else None
            elif isinstance(command, wire.Stop):
                self.stopped = True
                return

    def _add(self, add: wire.AddRequest, message: wire.StepMessage) -> None:
        constraint = add.params.structured
        if constraint is None:
            self._admit(add, message)
        else:  # compiled here, off the step loop; a cache hit when the request joins
            self.compiling.append((self.compiler.submit(self.engine.grammars.matcher,
                                                        constraint), add))

    def _join_compiled(self, message: wire.StepMessage) -> None:
        if not self.compiling:
            return
        waiting = []
        for future, add in self.compiling:
            if not future.done():
                waiting.append((future, add))
            elif future.exception() is not None:
                message.errors.append(wire.RequestError(add.request_id,
                                                        str(future.exception())))
            else:
                self._admit(add, message)
        self.compiling = waiting

    def _admit(self, add: wire.AddRequest, message: wire.StepMessage) -> None:
        try:
            request = self.engine.make_request(add.prompt_token_ids, add.params, add.request_id,
                                               add.cache_salt)
            request.prompt_text = add.prompt_text
            request.arrival_time = add.arrival_time
            request.rendered_time = add.rendered_time
            request.tokenized_time = add.tokenized_time
            request.queued_time = add.queued_time
            self.engine.add(request)
        except ValueError as error:
            message.errors.append(wire.RequestError(add.request_id, str(error)))
            return
        self.requests[add.request_id] = request

    def _abort(self, request_id: str, message: wire.StepMessage) -> None:
        for index, (_, add) in enumerate(self.compiling):
            if add.request_id == request_id:
                del self.compiling[index]
                message.outputs.append(_aborted(request_id))
                return
        output = self.engine.abort(request_id)
        if output is not None:
            message.outputs.append(output)

    # ------------------------------------------------------------------ output
    def _send(self, message: wire.StepMessage) -> None:
        message.step_stats, message.request_stats = self.stats.take()
        self._publish_gauges()
        if not (message.outputs or message.errors or message.request_stats
                or message.step_stats):
            return
        for position, output in enumerate(message.outputs):
            if output.finished:
                message.finished.append(self._times(output.request_id))
            message.outputs[position] = wire.without_prompt(output)
        proposer = self.engine.proposer
        if proposer is not None and hasattr(proposer, "cache_stats"):
            message.suffix_cache = proposer.cache_stats()
        try:  # the front may be gone (then _check_parent ends this process); never block
            self.events.send(self.encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("the API process takes no outputs; %d dropped", len(message.outputs))

    def _times(self, request_id: str) -> wire.RequestTimes:
        request = self.requests.pop(request_id, None)
        if request is None:  # aborted while its grammar compiled: never admitted
            return wire.RequestTimes(request_id, "abort", None, None, None, time.monotonic())
        return wire.RequestTimes(request_id, request.status.value,
                                 request.first_scheduled_time, request.first_token_time,
                                 request.last_token_time, request.finished_time)

    def _publish_gauges(self) -> None:
        engine = self.engine
        blocks = engine.block_manager
        self.gauges.publish(len(engine.scheduler.running),
                            len(engine.scheduler.waiting) + len(self.compiling), blocks.usage,
                            blocks.num_free_blocks, blocks.num_blocks,
                            engine.has_unfinished() or bool(self.compiling))

    def _check_parent(self) -> None:
        """An engine whose front is gone (killed, or exited with os._exit) stops: nobody would
        read it, and it holds the device."""
        now = time.monotonic()
        if now - self._last_parent_check < 1.0:
            return
        self._last_parent_check = now
        if self.parent is not None and not self.parent.is_alive():
            logger.warning("the API process is gone; the engine process exits")
            os._exit(0)


def _aborted(request_id: str):
    """The final output of a request aborted before it joined the engine."""
    from engine.outputs import RequestOutput

    return RequestOutput(request_id, [], "", [], "", [], True, finish_reason="abort")


def run_engine_core(config, commands_address: str, events_address: str,
                    gauges: SharedGauges, log_level: int = logging.INFO) -> None:
    """The engine process's main (multiprocessing 'spawn' target). Exits 0 after a Stop, 1
    after a failed build or a failed step. `log_level`: the API process's."""
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(commands_address)
    events = context.socket(zmq.PUSH)
    events.setsockopt(zmq.SNDHWM, 0)  # a front that reads late gets everything, later
    events.connect(events_address)
    encoder = wire.Encoder()
    try:
        engine = _build(config)
    except BaseException as error:  # the front raises it (a ValueError: the user's to fix)
        events.send(encoder.encode(wire.BuildFailed(type(error).__name__, str(error))))
        _close(context, events)
        os._exit(1)
    events.send(encoder.encode(_ready(engine, config)))
    core = EngineCore(engine, commands, events, gauges)
    try:
        core.run()
    except Exception as error:  # no one request's fault: the engine cannot be trusted now
        logger.exception("engine step failed outside any one request; the engine stops")
        events.send(encoder.encode(wire.Dead(f"{type(error).__name__}: {error}")))
        _close(context, events)
        os._exit(1)
    _close(context, events)


def _build(config):
    from engine.core.device import release_freed_host_memory
    from engine.engine import LLMEngine

    engine = LLMEngine(config)
    release_freed_host_memory()
    return engine


def _ready(engine, config) -> wire.Ready:
    from engine.models.loader import keeps_gguf_blocks, locate_model

    path, _ = locate_model(config.model.model)
    limits = engine.limits
    proposer = engine.proposer
    return wire.Ready(
        pid=os.getpid(), model_name=engine.model_name, model_folder=str(engine.model_folder),
        native_tokenizer=keeps_gguf_blocks(path, engine.device, engine.dtype,
                                           config.model.quantization),
        vocab_size=engine.vocab_size, eos_token_ids=sorted(engine.eos_token_ids),
        num_kv_blocks=limits.num_kv_blocks, block_size=limits.block_size,
        max_model_len=limits.max_model_len, kv_window=engine.block_manager.window,
        has_suffix_cache=proposer is not None and hasattr(proposer, "cache_stats"))


def _close(context: zmq.Context, events: zmq.Socket) -> None:
    """Sends what is queued (up to 5 s: the front may be gone), then closes every socket."""
    events.close(linger=5000)
    context.destroy(linger=0)
