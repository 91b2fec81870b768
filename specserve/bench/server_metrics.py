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
