"""Chat templates rendered with limits on time, memory and size (`--chat-template-timeout`,
`--chat-template-max-bytes`).

Renderings run in child processes (`server/template_worker.py`): a Python thread cannot be
stopped, a process can. A rendering that overruns its time is killed with its process, so a
template that spins for some messages costs those requests a 400 and nobody else anything; one
that grows without bound hits the child's address space limit. The event loop only writes and
reads pipes.

The pool is elastic, because each renderer costs ~22 MB resident and one renders every request of
a normal load (a rendering takes ~1 ms): it starts with one renderer, and a request that has waited
GROW_AFTER_S for one (a template is stuck, or the load is heavy) starts another in the background,
up to `--chat-template-workers`. A killed renderer is replaced only when it was the last one, so
one is always warm; otherwise the pool shrinks and grows again on demand. `/ready` fails while
requests wait, no renderer is free and the pool cannot grow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass

from server.errors import SERVER_ERROR, APIError
from server.template_worker import encode_frame

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_WORKERS = 2
START_TIMEOUT_S = 60.0  # a child's Python start and imports, on a loaded machine
# A wait this long for a renderer means they are all stuck (or the load is heavy), not finishing
# a ~1 ms rendering: the pool grows.
GROW_AFTER_S = 0.05
# After a renderer failed to start, the pool tries again no sooner than this: a start that fails
# at once (fork refused, say) must not become a loop of starts and tracebacks.
RETRY_START_AFTER_S = 1.0
# A conversation every template should take, checked once at startup.
SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Tell me a short joke."},
]


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES  # of the rendered prompt
    workers: int = DEFAULT_WORKERS

    @property
    def memory_bytes(self) -> int:
        """A child's address space beyond its start: the text, Jinja's pieces of it, its encoding
        and its JSON frame, with room for the template's own values."""
        return 8 * self.max_bytes + 256 * 1024 * 1024


class TemplateLimitError(Exception):
    """A rendering broke a limit: too slow, too large or out of memory."""


class _Renderer:
    """One child process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    @classmethod
    async def start(cls, setup: dict) -> _Renderer:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.template_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        renderer = cls(process)
        try:
            await renderer._send(setup)
            await asyncio.wait_for(renderer._receive(), START_TIMEOUT_S)  # {"ready": true}
        except BaseException:  # failed, or cancelled by close(): no child left behind
            await renderer.kill()
            raise
        return renderer

    async def call(self, request: dict) -> dict:
        await self._send(request)
        return await self._receive()

    async def _send(self, value: dict) -> None:
        self.process.stdin.write(encode_frame(value))
        await self.process.stdin.drain()

    async def _receive(self) -> dict:
        header = await self.process.stdout.readline()
        if not header:
            raise ConnectionError("the chat-template renderer exited")
        return json.loads(await self.process.stdout.readexactly(int(header)))

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        # asyncio's Process has no close(); unclosed, its transport warns (with a traceback)
        # when collected after the loop has closed.
        transport = getattr(self.process, "_transport", None)
        if transport is not None:
            transport.close()


class ChatTemplates:
    """Renders conversations through the model's templates, in 1 to `limits.workers` renderers."""

    def __init__(self, special_tokens: dict, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        self._setup = {"special_tokens": special_tokens, "max_bytes": limits.max_bytes,
                       "memory_bytes": limits.memory_bytes}
        self._idle: asyncio.Queue = asyncio.Queue()  # of _Renderer, then _CLOSED
        self._all: set[_Renderer] = set()  # started: idle or rendering
        self._starting: set[asyncio.Task] = set()  # each brings one more renderer to the pool
        self._tasks: set[asyncio.Task] = set()  # every start and kill in the background
        self._num_waiting = 0
        self._no_start_before = 0.0  # time.monotonic(); set by a start that failed
        self._closed = False

    async def start(self) -> None:
        """One renderer: more start only when renderings wait (each costs ~22 MB resident)."""
        self._add(await _Renderer.start(self._setup))

    @property
    def saturated(self) -> bool:
        """Requests are waiting, no renderer is free and no more may start (the pool is at its
        limit, starting ones counted, or pausing after a failed start): templates are stuck (or
        the load is more than the pool takes), which `/ready` reports."""
        return self._num_waiting > 0 and self._idle.empty() and not self._may_grow()

    def _may_grow(self) -> bool:
        return (not self._closed and time.monotonic() >= self._no_start_before
                and len(self._all) + len(self._starting) < self.limits.workers)

    async def render(self, template: str, messages: list[dict], tools: list[dict] | None,
                     add_generation_prompt: bool) -> str:
        """The prompt text; TemplateLimitError when a limit broke, APIError 400 when the
        template refused or failed on these messages."""
        request = {"template": template, "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        renderer = await self._take()
        try:
            reply = await asyncio.wait_for(renderer.call(request), self.limits.timeout_s)
        except BaseException as error:  # too slow, died, or our caller was cancelled mid-call
            self._replace(renderer)
            if isinstance(error, TimeoutError):
                raise TemplateLimitError(f"took longer than {self.limits.timeout_s:g} s to "
                                         "render (--chat-template-timeout)") from None
            if self._closed:
                raise _shutting_down() from None
            if isinstance(error, (ConnectionError, asyncio.IncompleteReadError)):
                raise APIError(500, "the chat-template renderer died while rendering these "
                               "messages", SERVER_ERROR) from None
            raise
        self._idle.put_nowait(renderer)
        if "text" in reply:
            return reply["text"]
        if reply["error"] == "size":
            raise TemplateLimitError(f"{reply['message']}, more than the limit of "
                                     f"{self.limits.max_bytes} (--chat-template-max-bytes)")
        if reply["error"] == "memory":
            raise TemplateLimitError(f"{reply['message']} "
                                     f"({self.limits.memory_bytes >> 20} MiB)")
        raise APIError(400, "the model's chat template cannot render these messages: "
                       f"{reply['message']}", param="messages")

    async def _take(self) -> _Renderer:
        """The first renderer to be idle, whichever. Each GROW_AFTER_S without one, the pool
        grows if it may and fewer renderers are starting than requests wait (one start per
        waiter, not one per period); asked again each period, since a renderer killed meanwhile
        makes room."""
        if not self._idle.empty():
            renderer = self._idle.get_nowait()
        else:
            self._num_waiting += 1
            taking = asyncio.ensure_future(self._idle.get())  # one place in the queue's line
            try:
                while not taking.done():
                    await asyncio.wait([taking], timeout=GROW_AFTER_S)
                    if (not taking.done() and self._may_grow()
                            and len(self._starting) < self._num_waiting):
                        self._start_in_background()
            except BaseException:  # our caller was cancelled: a renderer we got goes back
                if taking.done():
                    self._idle.put_nowait(taking.result())
                else:
                    taking.cancel()
                raise
            finally:
                self._num_waiting -= 1
            renderer = taking.result()
        if renderer is _CLOSED:
            self._idle.put_nowait(_CLOSED)  # for the next waiter
            raise _shutting_down()
        return renderer

    async def check(self, template: str) -> None:
        """At startup: the sample conversation renders within the limits (TemplateLimitError
        otherwise). A template that refuses the sample's shape is only logged: it may want
        another one (no system turn, say)."""
        try:
            await self.render(template, SAMPLE_CONVERSATION, None, add_generation_prompt=True)
        except APIError as error:
            logger.warning("the chat template refuses a sample conversation: %s", error.message)

    def _add(self, renderer: _Renderer) -> None:
        self._all.add(renderer)
        self._idle.put_nowait(renderer)

    def _replace(self, renderer: _Renderer) -> None:
        """Kills `renderer` in the background: the request that broke a limit gets its answer
        now. Another starts only when none is left, so the next request finds one warm;
        otherwise the pool shrinks, and grows again when renderings wait."""
        self._all.discard(renderer)
        self._in_background(renderer.kill())
        if not self._all and not self._starting and not self._closed:
            self._start_in_background()

    def _start_in_background(self) -> None:
        self._starting.add(self._in_background(self._start_one()))

    def _in_background(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start_one(self) -> None:
        try:
            renderer = await _Renderer.start(self._setup)
        except Exception:
            self._no_start_before = time.monotonic() + RETRY_START_AFTER_S
            logger.exception("a chat-template renderer failed to start")
            return
        finally:  # now, not in a done callback: a renderer is never counted twice
            self._starting.discard(asyncio.current_task())
        if self._closed:
            await renderer.kill()
        else:
            self._add(renderer)

    async def close(self) -> None:
        """Kills every renderer, busy and starting ones too: their requests, and any waiting for
        one, get 503 `server_draining` (they were not admitted yet, so a drain would refuse them
        anyway), and shutdown never waits for a template. Idempotent."""
        if not self._closed:
            self._closed = True
            self._idle.put_nowait(_CLOSED)
            for task in self._starting:
                task.cancel()  # _Renderer.start kills its child
        while self._all or self._tasks:  # a rendering that fails meanwhile adds a kill
            renderers, self._all = self._all, set()
            await asyncio.gather(*self._tasks, *(renderer.kill() for renderer in renderers),
                                 return_exceptions=True)


_CLOSED = object()  # in the idle queue once the pool is closed


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", SERVER_ERROR,
                    code="server_draining", headers={"Retry-After": "1"})
