"""Streamed requests to an OpenAI-compatible server, sent at a fixed concurrency or as a Poisson
process, each timed chunk by chunk into a `RequestRecord`.

Every request streams (`stream_options.include_usage`, so the server's own token count is used
when it sends one; otherwise each text-carrying chunk counts as one token). A failed request is
recorded with its error, never retried, and the run goes on. For soak runs, a share of the clients
can hang up at a random moment (`Disconnects`); those records carry the error `CANCELLED`, which is
the client's doing, not a failure of the server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import httpx

from specserve.bench.mixed import answer_violation
from specserve.bench.serving_metrics import RequestRecord
from specserve.bench.workloads import Workload

ENDPOINTS = ("auto", "completions", "chat")
CANCELLED = "cancelled by the client (a planned disconnect)"
ANSWER_VIOLATION = "answer_violation"


@dataclass(frozen=True)
class Target:
    """One server under test."""

    label: str
    base_url: str  # without /v1
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run asks for."""

    endpoint: str  # "auto": raw prompts to /v1/completions, chat prompts to /v1/chat/completions
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False  # a vLLM extension; specserve and vLLM honour it


def request_body(target: Target, workload: Workload, options: RequestOptions) -> tuple[str, dict]:
    """(path, JSON body) of one request, streamed unless the workload says otherwise."""
    chat = workload.chat if options.endpoint == "auto" else options.endpoint == "chat"
    body: dict = {"model": target.model, "max_tokens": options.max_tokens,
                  "temperature": options.temperature, "stream": workload.stream,
                  **(workload.extra or {})}
    if workload.stream:
        body["stream_options"] = {"include_usage": True}
    if options.seed is not None:
        body["seed"] = options.seed
    if options.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": workload.text}]
        return "/v1/chat/completions", body
    body["prompt"] = workload.text
    return "/v1/completions", body


class _Answer:
    """What a response said, gathered chunk by chunk (or at once): text, tool calls (name and
    arguments by index) and finish reason, for `answer_violation`."""

    def __init__(self):
        self.text = ""
        self.calls: dict[int, list[str]] = {}
        self.finish_reason: str | None = None

    def add(self, choice: dict) -> bool:
        """Takes one choice (a chunk's or a whole response's); True when it carried output."""
        part = choice.get("delta") or choice.get("message") or {}
        text = choice.get("text") or part.get("content") or ""
        self.text += text
        for index, call in enumerate(part.get("tool_calls") or []):
            name_and_arguments = self.calls.setdefault(call.get("index", index), ["", ""])
            function = call.get("function") or {}
            name_and_arguments[0] += function.get("name") or ""
            name_and_arguments[1] += function.get("arguments") or ""
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return bool(text or part.get("tool_calls"))

    def violation(self, workload: Workload) -> str | None:
        calls = [tuple(self.calls[index]) for index in sorted(self.calls)]
        return answer_violation(workload.extra, self.text, calls, self.finish_reason)


async def send(client: httpx.AsyncClient, target: Target, workload: Workload,
               options: RequestOptions) -> RequestRecord:
    """One request, timed; errors (an answer that breaks what it asked for is one) end up in
    the record, not raised."""
    path, body = request_body(target, workload, options)
    record = RequestRecord(prompt_id=workload.id, kind=workload.kind, start=time.perf_counter())
    answer = _Answer()
    try:
        async with client.stream("POST", target.base_url + path, json=body,
                                 headers=target.headers) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return record
            reader = _read_stream if workload.stream else _read_whole
            usage = await reader(response, answer, record)
            if record.error:
                return record
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
        return record
    finally:
        record.end = time.perf_counter()
    violation = answer.violation(workload)
    if violation:
        record.error = f"{ANSWER_VIOLATION}: {violation}"
    record.output_tokens = (usage or {}).get("completion_tokens") or len(record.chunk_times)
    record.text = answer.text + (json.dumps(answer.calls, sort_keys=True) if answer.calls else "")
    record.prompt_tokens = (usage or {}).get("prompt_tokens")
    return record


async def _read_whole(response: httpx.Response, answer: _Answer, record: RequestRecord):
    """A whole (unstreamed) response: no chunk times (it has no TTFT, TPOT or ITL; its latency
    counts). Returns its usage."""
    whole = json.loads(await response.aread())
    for choice in whole.get("choices") or []:
        answer.add(choice)
    return whole.get("usage")


async def _read_stream(response: httpx.Response, answer: _Answer, record: RequestRecord):
    """Server-sent events up to [DONE], timing each chunk that carries output; an error event
    goes into the record. Returns the last usage seen."""
    usage = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            record.error = f"stream error: {event['error'].get('message', event['error'])}"
            return None
        if any([answer.add(choice) for choice in event.get("choices") or []]):
            record.chunk_times.append(time.perf_counter())
        usage = event.get("usage") or usage
    return usage


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps of mean 1/rate after the first (a
    Poisson process), all zero for an infinite rate."""
    return list(itertools.islice(endless_gaps(request_rate, seed), num_requests))


def endless_gaps(request_rate: float, seed: int) -> Iterator[float]:
    """`arrival_gaps` without an end, for runs bounded by time."""
    gaps = random.Random(seed)
    yield 0.0
    while True:
        yield 0.0 if request_rate == float("inf") else gaps.expovariate(request_rate)


@dataclass(frozen=True)
class Disconnects:
    """Clients that hang up: each request, with probability `fraction`, is abandoned (its
    connection closed) after a delay drawn uniformly from [0, `within_s`) seconds; one that
    finishes first simply finishes."""

    fraction: float = 0.0
    within_s: float = 5.0

    def plan(self, seed: int) -> Iterator[float | None]:
        """The abandon delay of each request in turn, None for clients that stay."""
        draws = random.Random(seed + 1)
        while True:
            stays = draws.random() >= self.fraction
            delay = draws.uniform(0, self.within_s)
            yield None if stays else delay


async def run_load(client: httpx.AsyncClient, target: Target, workloads: Iterable[Workload],
                   options: RequestOptions, max_concurrency: int | None, request_rate: float,
                   seed: int, on_done: Callable[[], None] = lambda: None,
                   duration_s: float | None = None, disconnects: Disconnects = Disconnects(),
                   ) -> tuple[list[RequestRecord], float]:
    """Sends the workloads in order: a new request starts when one of `max_concurrency` slots is
    free (None: no cap) and, for a finite `request_rate` (requests/s), after an exponentially
    distributed gap. With `duration_s`, no request starts after that many seconds (pass an
    endless iterable, e.g. `itertools.cycle`). Returns the records in send order and the wall
    time."""
    slots = asyncio.Semaphore(max_concurrency or 1_000_000)

    async def one(workload: Workload, abandon_after: float | None) -> RequestRecord:
        start = time.perf_counter()
        try:
            if abandon_after is None:
                return await send(client, target, workload, options)
            return await asyncio.wait_for(send(client, target, workload, options),
                                          abandon_after)
        except asyncio.TimeoutError:  # wait_for cancelled the request: the connection closed
            return RequestRecord(workload.id, workload.kind, start, time.perf_counter(),
                                 error=CANCELLED)
        finally:
            slots.release()
            on_done()

    start = time.perf_counter()
    tasks = []
    for workload, gap, abandon_after in zip(workloads, endless_gaps(request_rate, seed),
                                            disconnects.plan(seed)):
        if gap:
            await asyncio.sleep(gap)
        if duration_s is not None and time.perf_counter() - start >= duration_s:
            break
        await slots.acquire()
        tasks.append(asyncio.create_task(one(workload, abandon_after)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start
