"""What one streamed request measured, and the serving metrics of many, as `vllm bench serve`
defines them.

  TTFT   first chunk carrying output text - request sent
  TPOT   (e2e latency - TTFT) / (output tokens - 1), per request with more than one token
  ITL    the gap between consecutive text chunks, over all requests (one chunk may carry several
         tokens: a speculative step streams every token it accepted at once)
  E2EL   last byte - request sent

Throughputs divide by the wall time of the whole run. Times are seconds in records and
milliseconds in summaries, as vLLM prints them. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timeline, from perf_counter readings taken by the load generator."""

    prompt_id: str
    kind: str
    start: float  # request sent
    end: float = 0.0  # response finished (or failed)
    chunk_times: list[float] = field(default_factory=list)  # arrivals of text-carrying chunks
    output_tokens: int = 0  # usage.completion_tokens, or the count of text chunks without usage
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    error: str | None = None
    text: str = ""  # what the answer said: its text, then its tool calls as JSON, if any

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token answers."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def distribution_ms(seconds: list[float]) -> dict[str, float | None]:
    """mean, std, p50, p90 and p99 in milliseconds; None everywhere when there are no values."""
    keys = ["mean", "std"] + [f"p{q}" for q in PERCENTILES]
    if not seconds:
        return dict.fromkeys(keys)
    millis = [value * 1000 for value in seconds]
    summary = {"mean": statistics.fmean(millis), "std": statistics.pstdev(millis)}
    summary.update({f"p{q}": percentile(millis, q) for q in PERCENTILES})
    return {key: round(value, 3) for key, value in summary.items()}


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """The serving metrics of one run: `duration` is the wall time from the first request sent to
    the last response finished."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    done = [record for record in records if record.ok]
    output_tokens = sum(record.output_tokens for record in done)
    input_tokens = sum(record.prompt_tokens or 0 for record in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({record.error for record in records if not record.ok})[:10],
        "duration_s": round(duration, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(done) / duration, 4),
        "output_throughput": round(output_tokens / duration, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 3),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls]),
        "e2el_ms": distribution_ms([r.latency for r in done]),
    }


def output_digest(text: str) -> str:
    """A short fingerprint of an answer's text: two servers that generated the same tokens give
    the same digest, so greedy outputs can be compared without keeping the texts."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def outputs_of(records: list[RequestRecord], with_texts: bool = False) -> list[list[str]]:
    """[prompt id, digest] (and the text, `with_texts`) of each completed request, in send
    order."""
    return [[record.prompt_id, output_digest(record.text)] + ([record.text] if with_texts else [])
            for record in records if record.ok]


def timeline(records: list[RequestRecord], window_s: float, cancelled: str) -> list[dict]:
    """The run in windows of `window_s` seconds by finishing time (from the first request sent):
    each window's completed, failed and client-cancelled requests (`cancelled` is the error of a
    planned hang-up) and the latency p50 / p99 of those completed, for soak plots."""
    if not records:
        return []
    origin = min(record.start for record in records)
    windows: dict[int, list[RequestRecord]] = {}
    for record in records:
        windows.setdefault(int((record.end - origin) // window_s), []).append(record)
    rows = []
    for index in range(max(windows) + 1):
        batch = windows.get(index, [])
        done = [record.latency for record in batch if record.ok]
        latency = distribution_ms(done)
        rows.append({"t_s": round((index + 1) * window_s, 3), "completed": len(done),
                     "failed": sum(1 for r in batch if not r.ok and r.error != cancelled),
                     "client_disconnects": sum(1 for r in batch if r.error == cancelled),
                     "e2el_p50_ms": latency["p50"], "e2el_p99_ms": latency["p99"]})
    return rows
