"""Writes the Grafana dashboards: edit the panels here, then regenerate the checked-in JSON.

    python deploy/grafana/generate_dashboards.py
    python deploy/grafana/generate_dashboards.py --prefix vllm --output /tmp/vllm-dashboards

The checked-in files use the default metric prefix `specserve`; a server started with
`--metrics-prefix vllm` needs a set generated with `--prefix vllm` (own uids, so both sets can be
provisioned side by side).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grafana_json import (
    RATE_WINDOW,
    Panel,
    PromQL,
    Row,
    Target,
    dashboard,
    latency_panel,
    ratio,
)

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboards"


def overview(prefix: str) -> dict:
    q = PromQL(prefix)
    lag = f"{prefix}:event_loop_lag_seconds_bucket"
    output_tokens = q.rate("generation_tokens_total")
    rows = [
        Row("Load", (
            Panel("Requests running", "Requests in the running batch.",
                  (Target(f"sum({q.series('num_requests_running')})", "running"),),
                  kind="stat", width=5, height=4),
            Panel("Requests waiting", "Requests waiting for a batch slot or KV blocks.",
                  (Target(f"sum({q.series('num_requests_waiting')})", "waiting"),),
                  kind="stat", width=5, height=4),
            Panel("KV cache usage", "Share of KV cache blocks held by requests (the fullest "
                  "instance).", (Target(f"max({q.series('kv_cache_usage_perc')})", "usage"),),
                  unit="percentunit", kind="stat", width=5, height=4, max=1),
            Panel("Output tokens/s", "Generated tokens per second over the last minute.",
                  (Target(output_tokens, "output"),), unit="short", kind="stat", width=5,
                  height=4, decimals=1),
            Panel("Finished requests/s", "Requests finished per second, any finish reason.",
                  (Target(q.rate("request_success_total"), "finished"),), unit="reqps",
                  kind="stat", width=4, height=4, decimals=2),
        )),
        Row("Latency", (
            latency_panel(q, "Time to first token", "time_to_first_token_seconds",
                          "From arrival to the first output token: queueing plus prefill."),
            latency_panel(q, "Inter-token latency", "inter_token_latency_seconds",
                          "Time between two outputs of one request (a verify step that accepts "
                          "drafts delivers several tokens in one output)."),
            latency_panel(q, "Time per output token", "request_time_per_output_token_seconds",
                          "Decode time of a request divided by its output tokens after the first."),
            latency_panel(q, "End-to-end request latency", "e2e_request_latency_seconds",
                          "From arrival to the last token."),
            latency_panel(q, "Queue time", "request_queue_time_seconds",
                          "From arrival until the request is first scheduled."),
            Panel("Prefill and decode time", "Per request: scheduled to first token (prefill) "
                  "and first token to finish (decode).", (
                      Target(q.quantile(0.5, "request_prefill_time_seconds"), "prefill p50"),
                      Target(q.quantile(0.99, "request_prefill_time_seconds"), "prefill p99"),
                      Target(q.quantile(0.5, "request_decode_time_seconds"), "decode p50"),
                      Target(q.quantile(0.99, "request_decode_time_seconds"), "decode p99"),
                  ), unit="s"),
        )),
        Row("Throughput", (
            Panel("Token throughput", "Prompt tokens computed (prefix-cache hits excluded) and "
                  "output tokens generated, per second.", (
                      Target(output_tokens, "output tokens/s"),
                      Target(q.rate("prompt_tokens_total"), "prompt tokens/s"),
                  )),
            Panel("Finish reasons", "Finished requests per second by reason: stop (EOS or a stop "
                  "string), length (max_tokens or context), abort (client gone or cancelled).",
                  (Target(q.rate("request_success_total", by="finished_reason"),
                          "{{finished_reason}}"),), unit="reqps"),
            Panel("Request lengths", "Prompt and generated tokens per finished request.", (
                Target(q.quantile(0.5, "request_prompt_tokens"), "prompt p50"),
                Target(q.quantile(0.9, "request_prompt_tokens"), "prompt p90"),
                Target(q.quantile(0.5, "request_generation_tokens"), "generated p50"),
                Target(q.quantile(0.9, "request_generation_tokens"), "generated p90"),
            )),
            Panel("HTTP requests", "HTTP requests per second by route and status (all models: "
                  "this counter has no model_name label).",
                  (Target(q.server_rate("http_requests_total", by="route, status"),
                          "{{route}} {{status}}"),), unit="reqps"),
            Panel("Event-loop lag", "How late the server's event loop woke a task that sleeps "
                  "20 ms: time in which no request, /health included, could be read or "
                  "answered (all models: no model_name label).",
                  (Target(f"histogram_quantile(0.99, sum by (le) (rate({lag}[{RATE_WINDOW}])))",
                          "p99"),), unit="s"),
            Panel("Event-loop stalls", "Wake-ups of the event loop later than 50 ms, per "
                  "second; the target is none.",
                  (Target(f'sum(rate({lag}{{le="+Inf"}}[{RATE_WINDOW}])) - '
                          f'sum(rate({lag}{{le="0.05"}}[{RATE_WINDOW}]))', "stalls/s"),)),
        )),
        Row("Engine", (
            Panel("Running and waiting requests", "Requests in the running batch and waiting "
                  "for a slot; a growing waiting line means the server is saturated.", (
                      Target(f"sum({q.series('num_requests_running')})", "running"),
                      Target(f"sum({q.series('num_requests_waiting')})", "waiting"),
                  )),
            Panel("KV cache usage", "Share of KV cache blocks held by requests, per instance; "
                  "near 1, new requests wait and running ones get preempted.",
                  (Target(q.series("kv_cache_usage_perc"), "{{instance}}"),),
                  unit="percentunit", max=1),
            Panel("Preemptions", "Requests preempted per second (their KV blocks freed, to be "
                  "recomputed later) because the KV cache ran out.",
                  (Target(q.rate("num_preemptions_total"), "preemptions/s"),)),
            Panel("Prefix cache hit rate", "Share of looked-up prompt tokens found in the prefix "
                  "cache.", (Target(ratio(q.rate("prefix_cache_hits_total"),
                                          q.rate("prefix_cache_queries_total")), "hit rate"),),
                  unit="percentunit", max=1),
            Panel("Tokens per engine step", "Tokens one engine step computed (prompt chunks, "
                  "decode and draft tokens of the whole batch).", (
                      Target(q.quantile(0.5, "iteration_tokens_total"), "p50"),
                      Target(q.quantile(0.99, "iteration_tokens_total"), "p99"),
                      Target(q.mean("iteration_tokens_total"), "mean"),
                  )),
            latency_panel(q, "Engine step time", "engine_step_time_seconds",
                          "Duration of one engine step: schedule, model forward, sampling."),
        )),
    ]
    return dashboard(f"{prefix}-overview", f"{prefix} / overview",
                     "Latency, throughput and engine state of a specserve server.", prefix, rows)


def speculative(prefix: str) -> dict:
    q = PromQL(prefix)
    drafted = q.rate("spec_decode_num_draft_tokens_total")
    accepted = q.rate("spec_decode_num_accepted_tokens_total")
    num_drafts = q.rate("spec_decode_num_drafts_total")
    acceptance_rate = ratio(accepted, drafted)
    acceptance_length = f"1 + {ratio(accepted, num_drafts)}"
    draft_share = ratio(accepted, q.rate("generation_tokens_total"))
    current_k = q.series("spec_decode_current_k")
    per_position = (f"{q.rate('spec_decode_num_accepted_tokens_per_pos_total', by='position')}"
                    f" / ignoring(position) group_left() ({num_drafts} > 0)")
    rows = [
        Row("Is speculation paying off?", (
            Panel("Acceptance rate", "Accepted draft tokens / proposed draft tokens, last minute.",
                  (Target(acceptance_rate, "acceptance rate"),), unit="percentunit",
                  kind="stat", width=6, height=4, max=1),
            Panel("Mean acceptance length", "Tokens a verify step emits on average: 1 + accepted "
                  "/ verify steps with drafts (1 = speculation adds nothing).",
                  (Target(acceptance_length, "tokens per step"),), kind="stat", width=6,
                  height=4, min=1, decimals=2),
            Panel("Output tokens from drafts", "Share of generated tokens that were accepted "
                  "drafts rather than sampled one at a time.", (Target(draft_share, "share"),),
                  unit="percentunit", kind="stat", width=6, height=4, max=1),
            Panel("Current K", "Mean draft tokens per speculating request in the last step (the "
                  "controller lowers K when speculation does not pay).",
                  (Target(f"avg({current_k})", "K"),), kind="stat", width=6, height=4,
                  decimals=2),
        )),
        Row("Acceptance", (
            Panel("Acceptance rate", "Accepted / proposed draft tokens over time.",
                  (Target(acceptance_rate, "acceptance rate"),), unit="percentunit", max=1),
            Panel("Mean acceptance length", "1 + accepted draft tokens / verify steps with "
                  "drafts: the tokens each verify step emits.",
                  (Target(acceptance_length, "tokens per verify step"),), min=1),
            Panel("Acceptance by draft position", "Share of verify steps whose draft was "
                  "accepted through position i (0 = the first draft token); never increases "
                  "with the position.", (Target(per_position, "position {{position}}"),),
                  unit="percentunit", max=1),
            Panel("Output tokens from drafts", "Accepted draft tokens / generated tokens: how much "
                  "of the output came from drafts.", (Target(draft_share, "share"),),
                  unit="percentunit", max=1),
        )),
        Row("Draft tokens", (
            Panel("Draft tokens per second", "Proposed, accepted and rejected draft tokens, and "
                  "all tokens emitted by verify steps (accepted plus one sampled per step).", (
                      Target(drafted, "drafted"),
                      Target(accepted, "accepted"),
                      Target(f"{drafted} - {accepted}", "rejected"),
                      Target(q.rate("spec_decode_num_emitted_tokens_total"), "emitted"),
                  )),
            Panel("Current K and verify steps", "K (mean draft length in the last step, per "
                  "instance) and verify steps with drafts per second.", (
                      Target(current_k, "K {{instance}}"),
                      Target(num_drafts, "verify steps/s"),
                  )),
        )),
        Row("Cost", (
            Panel("Inter-token latency and step time", "What speculation costs: a verify step "
                  "runs longer than a plain decode step; it pays off while the tokens it emits "
                  "outweigh that.", (
                      Target(q.quantile(0.5, "inter_token_latency_seconds"), "ITL p50"),
                      Target(q.quantile(0.99, "inter_token_latency_seconds"), "ITL p99"),
                      Target(q.quantile(0.5, "engine_step_time_seconds"), "step p50"),
                      Target(q.quantile(0.99, "engine_step_time_seconds"), "step p99"),
                  ), unit="s"),
            Panel("Output tokens/s", "Generated tokens per second, and the part that came from "
                  "accepted drafts.", (
                      Target(q.rate("generation_tokens_total"), "output"),
                      Target(accepted, "from drafts"),
                  )),
        )),
    ]
    return dashboard(f"{prefix}-speculative", f"{prefix} / speculative decoding",
                     "Is speculation paying off, per model and draft position, and at what "
                     "latency cost.", prefix, rows)


def render(document: dict) -> str:
    return json.dumps(document, indent=2) + "\n"


def write_all(prefix: str, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in (("overview", overview), ("speculative", speculative)):
        path = output / f"{prefix}-{name}.json"
        path.write_text(render(build(prefix)))
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="specserve",
                        help="metric prefix the server exports (--metrics-prefix)")
    parser.add_argument("--output", type=Path, default=DASHBOARD_DIR, help="folder to write to")
    args = parser.parse_args()
    for path in write_all(args.prefix, args.output):
        print(path)


if __name__ == "__main__":
    main()
