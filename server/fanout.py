"""The fan-out of a response's choices into engine requests, read back as one stream of
(choice index, output)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.output_stream import merge_outputs
from engine.outputs import RequestOutput
from server.context import ServerContext

if TYPE_CHECKING:
    from server.generation import Choice


class FanOut:
    """Runs one engine request per choice and merges their outputs in arrival order.

    Starts at construction (after admission); `aclose()` aborts whatever is still running, so
    every path out of a route, a client disconnect included, must reach it.
    """

    _END = object()

    def __init__(self, context: ServerContext, response_id: str, choices: list[Choice],
                 final_only: bool = False):
        """`final_only`: each choice yields its first and last outputs only (a response that is
        not streamed needs no more, and each output costs the event loop a wake-up)."""
        context.admission.admit(self, len(choices))
        self._context = context
        self._final_only = final_only
        self._outputs: asyncio.Queue = asyncio.Queue()
        # With prefix caching, a prompt's other choices start once its first choice has a token:
        # its prompt blocks are cached by then, so the prompt is prefilled once, not n times.
        share = context.engine.config.cache.enable_prefix_caching
        prefilled: dict[int, asyncio.Event] = {}
        self._tasks = []
        # One choice is read straight from the engine's stream in the reader's task after its
        # first output: a pump task would cost the event loop a task switch per output. A task
        # takes that first output, so the engine request starts now, not at the first read.
        self._single = None
        self._single_waiting = len(choices) == 1
        if len(choices) == 1:
            outputs = context.engine.generate(
                choices[0].request, request_id=f"{response_id}-{choices[0].index}",
                final_only=final_only)
            self._single = (choices[0].index, outputs)
            self._tasks.append(asyncio.ensure_future(anext(outputs)))
            return
        for choice in choices:
            key = id(choice.prompt)
            after = prefilled.get(key) if share else None
            done = None
            if after is None:
                done = prefilled[key] = asyncio.Event()
            self._tasks.append(asyncio.create_task(
                self._pump(f"{response_id}-{choice.index}", choice, after, done)))

    async def _pump(self, request_id: str, choice: Choice, after: asyncio.Event | None,
                    done: asyncio.Event | None) -> None:
        waiting = True
        try:
            if after is not None:
                await after.wait()
            async for output in self._context.engine.generate(
                    choice.request, request_id=request_id, final_only=self._final_only):
                if waiting:
                    waiting = False
                    self._context.admission.release()
                    if done is not None:
                        done.set()
                self._outputs.put_nowait((choice.index, output))
        except Exception as error:
            self._outputs.put_nowait((choice.index, error))
        finally:
            if waiting:
                self._context.admission.release()
            if done is not None:
                done.set()
            self._outputs.put_nowait((choice.index, self._END))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) in arrival order. Whatever piled up while the reader was
        away (its client reads slower than the engine writes) comes as one merged output per
        choice: one SSE event, not one per step missed."""
        if self._single is not None:
            index, outputs = self._single
            try:
                first = await self._tasks[0]
            except StopAsyncIteration:
                return
            self._release_single()
            yield index, first
            async for output in outputs:  # merged already by the engine's OutputStream
                yield index, output
            return
        remaining = len(self._tasks)
        while remaining:
            items = [await self._outputs.get()]
            while not self._outputs.empty():
                items.append(self._outputs.get_nowait())
            by_choice: dict[int, list[RequestOutput]] = {}
            error = None
            for index, item in items:
                if item is self._END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    error = item  # what came before it is still sent; nothing after it
                    break
                else:
                    by_choice.setdefault(index, []).append(item)
            for index, outputs in by_choice.items():
                yield index, merge_outputs(outputs)
            if error is not None:
                raise error

    async def finals(self) -> dict[int, RequestOutput]:
        """Runs every choice to the end; its last output by choice index."""
        last = {}
        async for index, output in self:
            last[index] = output
        return last

    def _release_single(self) -> None:
        """The single choice's admission ends at its first output, or at `aclose`."""
        if self._single_waiting:
            self._single_waiting = False
            self._context.admission.release()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._single is not None:
            self._release_single()
            await self._single[1].aclose()  # aborts the engine request unless it finished
        self._context.admission.leave(self)
