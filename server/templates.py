"""Chat templates rendered with limits on time, memory and size (`--chat-template-timeout`,
`--chat-template-max-bytes`).

Renderings run in a small pool of child processes (`server/template_worker.py`): a Python thread
cannot be stopped, a process can. A rendering that overruns its time is killed with its process,
which is replaced in the background, so a template that spins for some messages costs those
requests a 400 and nobody else anything; one that grows without bound hits the child's address
space limit. The event loop only writes and reads pipes. `/ready` fails while every renderer is
taken and requests wait for one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass

from server.errors import SERVER_ERROR, APIError
from server.template_worker import encode_frame

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_WORKERS = 2
START_TIMEOUT_S = 60.0  # a child's Python start and imports, on a loaded machine
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
        await renderer._send(setup)
        await asyncio.wait_for(renderer._receive(), START_TIMEOUT_S)  # {"ready": true}
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
    """Renders conversations through the model's templates, `limits.workers` at a time."""

    def __init__(self, special_tokens: dict, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        self._setup = {"special_tokens": special_tokens, "max_bytes": limits.max_bytes,
                       "memory_bytes": limits.memory_bytes}
        self._idle: asyncio.Queue = asyncio.Queue()  # of _Renderer, then _CLOSED
        self._all: set[_Renderer] = set()
        self._tasks: set[asyncio.Task] = set()
        self._num_waiting = 0
        self._closed = False

    async def start(self) -> None:
        renderers = await asyncio.gather(*(_Renderer.start(self._setup)
                                           for _ in range(self.limits.workers)))
        for renderer in renderers:
            self._add(renderer)

    @property
    def saturated(self) -> bool:
        """Requests are waiting and no renderer is free: a template is spinning (or the load is
        more than the pool takes), which `/ready` reports."""
        return self._num_waiting > 0 and self._idle.empty()

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
        self._num_waiting += 1
        try:
            renderer = await self._idle.get()
        finally:
            self._num_waiting -= 1
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
        """Kills `renderer` and starts another in the background: the request that broke a limit
        gets its answer now, not after a Python start."""
        self._all.discard(renderer)
        task = asyncio.get_running_loop().create_task(self._start_one(renderer))
        self._tasks.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _start_one(self, replaced: _Renderer) -> None:
        await replaced.kill()
        if self._closed:
            return
        try:
            renderer = await _Renderer.start(self._setup)
        except Exception:
            logger.exception("a chat-template renderer failed to start")
            return
        if self._closed:
            await renderer.kill()
        else:
            self._add(renderer)

    async def close(self) -> None:
        """Kills every renderer, busy ones too: their requests, and any waiting for one, get 503
        `server_draining` (they were not admitted yet, so a drain would refuse them anyway), and
        shutdown never waits for a template. Idempotent."""
        self._closed = True
        self._idle.put_nowait(_CLOSED)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(renderer.kill() for renderer in self._all))
        self._all.clear()


_CLOSED = object()  # in the idle queue once the pool is closed


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", SERVER_ERROR,
                    code="server_draining", headers={"Retry-After": "1"})
