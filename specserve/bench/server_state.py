"""What a server holds, read from its Prometheus `/metrics`, for soak runs: resident memory, KV
cache usage, requests running and waiting. Taken before a run, every few seconds during it and once
the server has gone idle after it, so a leak shows as growth that outlives the load.

Names are matched without their namespace (`specserve:`, `vllm:`), as server_metrics.py does;
`process_resident_memory_bytes` is the standard process collector's (specserve and vLLM export it).
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.server_metrics import scrape

GAUGES = {
    "rss_bytes": "process_resident_memory_bytes",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
}


LOOP_LAG = "event_loop_lag_seconds_bucket"  # specserve's (server/loop_lag.py)
LOOP_LAG_BOUND_S = 0.05  # issue 48: no request holds the event loop longer


def loop_lag_buckets(exposition: str) -> dict[float, float]:
    """specserve's event-loop lag histogram in a text exposition: {bucket bound: wake-ups at
    or under it} (empty for a server that does not export it)."""
    return {float(sample.labels["le"]): sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples if sample.name.rsplit(":", 1)[-1] == LOOP_LAG}


def server_state(exposition: str) -> dict[str, float]:
    """The GAUGES found in a text exposition, summed over label sets, and where the server
    exports its event-loop lag, how many of its wake-ups so far came more than
    LOOP_LAG_BOUND_S late (`loop_lags_over_50ms`) and the smallest bucket bound that holds them
    all (`loop_lag_max_le_s`: the longest lag was at most that)."""
    by_name = {name: key for key, name in GAUGES.items()}
    state: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            key = by_name.get(sample.name.rsplit(":", 1)[-1])
            if key is not None:
                state[key] = state.get(key, 0.0) + sample.value
    lag_buckets = loop_lag_buckets(exposition)
    if lag_buckets:
        total = lag_buckets[float("inf")]
        state["loop_lags_over_50ms"] = total - lag_buckets.get(LOOP_LAG_BOUND_S, 0.0)
        bound = min(bound for bound, count in lag_buckets.items() if count == total)
        state["loop_lag_max_le_s"] = bound if bound < float("inf") else "inf"  # JSON has no inf
    return state


async def scrape_state(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    return await scrape(client, base_url,
                        lambda text: {"t": round(time.time(), 1), **server_state(text)})


async def state_when_idle(client: httpx.AsyncClient, base_url: str,
                          timeout_s: float = 60.0) -> dict[str, float] | None:
    """The state once no request runs or waits (or after `timeout_s`, flagged `idle: False`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await scrape_state(client, base_url)
        if state is None:
            return None
        idle = not state.get("num_requests_running") and not state.get("num_requests_waiting")
        if idle or time.monotonic() >= deadline:
            return {**state, "idle": idle}
        await asyncio.sleep(0.5)


async def sample_states(client: httpx.AsyncClient, base_url: str, every_s: float,
                        into: list[dict]) -> None:
    """Appends a scrape every `every_s` seconds until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        state = await scrape_state(client, base_url)
        if state is not None:
            into.append(state)
