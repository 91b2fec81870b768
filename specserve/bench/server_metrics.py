"""Speculative-decoding counters read from a server's Prometheus `/metrics`, before and after a run.

Servers name the same three counters differently; a sample's name is matched without its
namespace (`specserve:`, `vllm:`, `llamacpp:`, ...) and without a `_total` suffix:

  drafts        spec_decode_num_drafts (specserve, vLLM v1, llama.cpp), draft_verify_steps
  draft tokens  spec_decode_num_draft_tokens, n_drafted, n_draft, draft_tokens,
                spec_tokens_drafted (llama.cpp builds and forks over time)
  accepted      spec_decode_num_accepted_tokens, n_drafted_accepted, n_draft_accepted,
                draft_tokens_accepted, spec_tokens_accepted

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the
tokens one verify step yields, the bonus token included), as `vllm bench serve` reports them.

The request-timeline histograms (`TIMELINE_HISTOGRAMS`: vLLM's names where vLLM has one,
specserve's for the rest) are read the same way; a run's figures come from the growth of their
buckets, sums and counts: the mean exactly, quantiles interpolated inside a bucket as Prometheus's
`histogram_quantile` does. A server that exports none of them gets no section (None).
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTER_ALIASES = {
    "drafts": ("spec_decode_num_drafts", "draft_verify_steps"),
    "draft_tokens": ("spec_decode_num_draft_tokens", "n_drafted", "n_draft", "draft_tokens",
                     "spec_tokens_drafted"),
    "accepted_tokens": ("spec_decode_num_accepted_tokens", "n_drafted_accepted",
                        "n_draft_accepted", "draft_tokens_accepted", "spec_tokens_accepted"),
}
_ROLE_OF = {alias: role for role, aliases in COUNTER_ALIASES.items() for alias in aliases}
# The request's timeline, in the order a request lives it (engine/metrics/prometheus.py).
TIMELINE_HISTOGRAMS = (
    "request_template_time_seconds", "request_tokenize_time_seconds",
    "request_front_time_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "time_to_first_token_seconds", "request_first_token_write_delay_seconds",
    "time_to_first_token_written_seconds", "request_first_token_overhead_seconds",
    "inter_token_latency_seconds", "request_decode_time_seconds",
    "request_last_token_write_delay_seconds", "e2e_request_latency_seconds",
)
TIMELINE_QUANTILES = (0.5, 0.9, 0.99)


def spec_counters(exposition: str) -> dict[str, float]:
    """The speculative counters found in a Prometheus text exposition, summed over their label
    sets (per model, per engine); roles the server does not expose are absent."""
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = sample.name.rsplit(":", 1)[-1].removesuffix("_total")
            role = _ROLE_OF.get(name)
            if role is not None:
                counters[role] = counters.get(role, 0.0) + sample.value
    return counters


async def scrape(client: httpx.AsyncClient, base_url: str, parse):
    """`parse(exposition)` of `base_url`/metrics now; None when the server has no readable
    /metrics."""
    try:
        response = await client.get(f"{base_url}/metrics")
        if response.status_code != 200:
            return None
        return parse(response.text)
    except (httpx.HTTPError, ValueError):  # unreachable, or not the Prometheus text format
        return None


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The counters at `base_url`/metrics now; None when the server has no readable /metrics."""
    return await scrape(client, base_url, spec_counters)


def speculation_summary(before: dict[str, float] | None,
                        after: dict[str, float] | None) -> dict | None:
    """Acceptance over one run from the counters' growth; None when the server exposes none."""
    if not before or not after:
        return None
    delta = {role: after[role] - before.get(role, 0.0) for role in after}
    draft_tokens = delta.get("draft_tokens")
    accepted = delta.get("accepted_tokens")
    drafts = delta.get("drafts")
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": (round(accepted / draft_tokens, 4)
                            if accepted is not None and draft_tokens else None),
        "mean_acceptance_length": (round(1 + accepted / drafts, 4)
                                   if accepted is not None and drafts else None),
    }


def timeline_histograms(exposition: str) -> dict[str, dict]:
    """The timeline histograms found in an exposition, each summed over its label sets:
    {name: {"buckets": {upper bound: cumulative count}, "sum": seconds, "count": n}}."""
    wanted = set(TIMELINE_HISTOGRAMS)
    found: dict[str, dict] = {}
    for family in text_string_to_metric_families(exposition):
        name = family.name.rsplit(":", 1)[-1]
        if family.type != "histogram" or name not in wanted:
            continue
        histogram = found.setdefault(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                histogram["buckets"][bound] = histogram["buckets"].get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                histogram["sum"] += sample.value
            elif sample.name.endswith("_count"):
                histogram["count"] += sample.value
    return found


async def scrape_timeline(client: httpx.AsyncClient, base_url: str) -> dict[str, dict] | None:
    """The timeline histograms at `base_url`/metrics now; None without a readable /metrics."""
    return await scrape(client, base_url, timeline_histograms)


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of cumulative `buckets` ({upper bound: count}), linear inside the bucket
    it falls in (from 0 for the first); a quantile in the +Inf bucket is the largest finite
    bound. None for an empty histogram."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def timeline_summary(before: dict[str, dict] | None,
                     after: dict[str, dict] | None) -> dict | None:
    """Per timeline histogram, over one run: requests observed, mean and quantiles in ms. None
    when the server exports none of them (a server without them, or no /metrics)."""
    if not after:
        return None
    before = before or {}
    summary = {}
    for name in TIMELINE_HISTOGRAMS:
        if name not in after:
            continue
        now, then = after[name], before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        count = now["count"] - then["count"]
        buckets = {bound: value - then["buckets"].get(bound, 0.0)
                   for bound, value in now["buckets"].items()}
        row = {"count": int(count),
               "mean_ms": round(1000 * (now["sum"] - then["sum"]) / count, 3) if count else None}
        for q in TIMELINE_QUANTILES:
            value = bucket_quantile(q, buckets) if count else None
            row[f"p{round(q * 100)}_ms"] = None if value is None else round(1000 * value, 3)
        summary[name.removesuffix("_seconds")] = row
    return summary or None
