"""Hostile requests mixed into a `bench serve` run (`--hostile-rate`): bodies an attacker would
send to the structured-output path (issue 48), each of which the server must refuse with a 400,
quickly, while the run's own requests go on. Sent one at a time at a fixed rate, not streamed;
the report counts their answers by status and the slowest."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter

import httpx

from specserve.bench.load import Target


def hostile_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, JSON body): each is a 400 on a specserve server."""
    def schema(name: str, value: dict) -> bytes:
        return json.dumps({"model": model, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Hi"}],
                           "response_format": {"type": "json_schema", "json_schema": {
                               "name": name, "schema": value}}}).encode()

    def completion(structured: dict) -> bytes:
        return json.dumps({"model": model, "prompt": "Answer:", "max_tokens": 8,
                           "structured_outputs": structured}).encode()

    return [
        ("schema of 20,000 properties", "/v1/chat/completions", schema("big", {
            "type": "object", "properties": {f"p{i}": {"type": "string"}
                                             for i in range(20_000)}})),
        ("pattern a{1000000}", "/v1/chat/completions", schema("pattern", {
            "type": "object", "properties": {"a": {"type": "string",
                                                   "pattern": "^a{1000000}$"}}})),
        ("95 KB of optional properties", "/v1/chat/completions", schema("optional", {
            "type": "object", "properties": {f"field_{i:04d}": {"type": "integer"}
                                             for i in range(2_600)}})),
        ("choice of 100,000", "/v1/completions",
         completion({"choice": [f"option {i}" for i in range(100_000)]})),
    ]


async def send_hostile(client: httpx.AsyncClient, target: Target, rate: float,
                       report: dict) -> None:
    """Sends the hostile bodies in turn, `rate` a second, until cancelled; fills `report` with
    `sent`, `statuses` (status code -> count; "error" for a failed connection) and
    `max_seconds`."""
    bodies = hostile_bodies(target.model)
    statuses: Counter = Counter()
    report.update(sent=0, statuses={}, max_seconds=0.0)
    headers = {**target.headers, "Content-Type": "application/json"}
    for _name, path, body in itertools.cycle(bodies):
        started = time.monotonic()
        try:
            response = await client.post(f"{target.base_url}{path}", content=body,
                                         headers=headers)
            statuses[str(response.status_code)] += 1
        except httpx.HTTPError:
            statuses["error"] += 1
        seconds = time.monotonic() - started
        report.update(sent=report["sent"] + 1, statuses=dict(statuses),
                      max_seconds=round(max(report["max_seconds"], seconds), 4))
        await asyncio.sleep(max(0.0, 1.0 / rate - seconds))
