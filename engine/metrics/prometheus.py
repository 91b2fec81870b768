"""The one place where engine stats become Prometheus metrics.

Names follow vLLM v1's schema (`<prefix>:<name>`, label `model_name`), so `--metrics-prefix vllm`
makes specserve a drop-in for dashboards and benchmark tools built for vLLM. Counters are
exposed with prometheus_client's `_total` suffix, histograms with `_bucket/_sum/_count`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.metrics.stats import DeliveryStats, RequestStats, StepStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# The request timeline's spans before and around the first token: vLLM's latency buckets with
# sub-millisecond and few-millisecond steps added, since the front's costs (a template, a thread
# hop, a write) are counted in fractions of a millisecond and a target reads 3 ms.
TIMELINE_BUCKETS = tuple(sorted({0.0001, 0.00025, 0.0005, 0.002, 0.003, 0.0075, 0.015, 0.03,
                                 0.15, *LATENCY_BUCKETS}))
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PrometheusMetrics:
    """A stat listener (see `LLMEngine.add_stat_listener`) that keeps Prometheus metrics."""

    def __init__(self, model_name: str, registry: CollectorRegistry, prefix: str = "specserve",
                 engine_state: Callable[[], tuple[int, int, float]] | None = None,
                 num_speculative_tokens: int = 0):
        """`engine_state()` -> (running, waiting, kv_cache_usage), read at scrape time so the
        gauges are current even when no step runs (after the last request, after an abort).
        `num_speculative_tokens` (K): the per-position acceptance series 0..K-1 exist at 0 from
        the start, as vLLM's do, so dashboards have data before the first acceptance."""
        self.registry = registry
        self.model_name = model_name
        self.prefix = prefix
        self._children = {}
        labels = ["model_name"]

        def name(short: str) -> str:
            return f"{prefix}:{short}"

        def counter(short, doc, extra=()):
            return Counter(name(short), doc, labels + list(extra), registry=registry)

        def gauge(short, doc):
            return Gauge(name(short), doc, labels, registry=registry)

        def histogram(short, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name(short), doc, labels, buckets=buckets, registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that carried drafts")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted (bonus tokens excluded)")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position", ["position"])
        self.num_emitted_tokens = counter("spec_decode_num_emitted_tokens",
                                          "Tokens emitted by verify steps")
        self.num_forced_draft_tokens = counter(
            "spec_decode_num_forced_draft_tokens",
            "Draft tokens a grammar forced (structured outputs); also in num_draft_tokens")
        self.num_forced_accepted_tokens = counter(
            "spec_decode_num_forced_accepted_tokens", "Grammar-forced draft tokens accepted")
        self.method_draft_tokens = counter(
            "spec_decode_num_draft_tokens_by_method",
            "Guessed (not grammar-forced) draft tokens, by the method that proposed them",
            ["method"])
        self.method_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_by_method",
            "Guessed draft tokens accepted, by the method that proposed them", ["method"])
        self.current_k = gauge("spec_decode_current_k",
                               "Mean draft tokens per speculating request in the last step")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks held (0..1)")
        self.preemptions = counter("num_preemptions", "Requests preempted for recompute")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step",
                                          TOKEN_BUCKETS)
        self.step_time = histogram("engine_step_time_seconds", "Engine step duration")
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival (the HTTP route's entry) to first token sampled",
                              TIMELINE_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's outputs",
                             TIMELINE_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time per output token after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Handed to the engine to first scheduled", TIMELINE_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Scheduled to first token",
                                      TIMELINE_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish")
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First scheduled to finish")
        # specserve's own: the front before the engine, and the wait after a token is sampled
        # until its bytes are on the client's socket (the server's side of a client's TTFT).
        self.front_time = histogram("request_front_time_seconds", "Arrival to handed to the "
                                    "engine (body, chat template, tokenizing, checks)",
                                    TIMELINE_BUCKETS)
        self.render_time = histogram("request_template_time_seconds",
                                     "Arrival to chat template rendered", TIMELINE_BUCKETS)
        self.tokenize_time = histogram("request_tokenize_time_seconds",
                                       "Template rendered (or arrival) to prompt tokenized",
                                       TIMELINE_BUCKETS)
        self.first_write_delay = histogram("request_first_token_write_delay_seconds",
                                           "First token sampled to its bytes written",
                                           TIMELINE_BUCKETS)
        self.last_write_delay = histogram("request_last_token_write_delay_seconds",
                                          "Last token sampled to its bytes written",
                                          TIMELINE_BUCKETS)
        self.ttft_written = histogram("time_to_first_token_written_seconds",
                                      "Arrival to the first token's bytes written",
                                      TIMELINE_BUCKETS)
        self.first_token_overhead = histogram(
            "request_first_token_overhead_seconds", "Arrival to the first token's bytes "
            "written, less the prefill: the server's share of a client's TTFT",
            TIMELINE_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length", TOKEN_BUCKETS)
        self.generation_len = histogram("request_generation_tokens", "Generated length",
                                        TOKEN_BUCKETS)
        if engine_state is not None:
            for index, metric in enumerate((self.running, self.waiting, self.kv_usage)):
                metric.labels(model_name).set_function(
                    lambda index=index: engine_state()[index])
        self._live_gauges = engine_state is not None
        for reason in ("stop", "length", "abort"):  # exported at 0 before the first request
            self.success.labels(model_name, reason)
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                       self.num_emitted_tokens, self.num_forced_draft_tokens,
                       self.num_forced_accepted_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.prompt_tokens, self.generation_tokens):
            metric.labels(model_name)
        for position in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name, str(position))

    def on_step(self, stats: StepStats) -> None:
        # Runs on the engine thread after every step (~300 a second at batch 1 on CPU): labelled
        # children are looked up once, and counters skip zero increments.
        one = self._one
        spec = stats.spec
        for metric, value in ((self.num_drafts, spec.num_drafts),
                              (self.num_draft_tokens, spec.num_draft_tokens),
                              (self.num_accepted_tokens, spec.num_accepted_tokens),
                              (self.num_emitted_tokens, spec.num_emitted_tokens),
                              (self.num_forced_draft_tokens, spec.num_forced_draft_tokens),
                              (self.num_forced_accepted_tokens, spec.num_forced_accepted_tokens),
                              (self.preemptions, stats.num_preemptions),
                              (self.prefix_queries, stats.prefix_cache_queries),
                              (self.prefix_hits, stats.prefix_cache_hits),
                              (self.prompt_tokens, stats.num_prompt_tokens),
                              (self.generation_tokens, stats.num_generated_tokens)):
            if value:
                one(metric).inc(value)
        for method, count in spec.draft_tokens_by_method.items():
            self.method_draft_tokens.labels(self.model_name, method).inc(count)
            accepted = spec.accepted_tokens_by_method.get(method, 0)
            if accepted:
                self.method_accepted_tokens.labels(self.model_name, method).inc(accepted)
        for position, count in enumerate(spec.accepted_per_position):
            if count:
                self.accepted_per_pos.labels(self.model_name, str(position)).inc(count)
        one(self.current_k).set(stats.current_k)
        if not self._live_gauges:
            one(self.running).set(stats.num_running)
            one(self.waiting).set(stats.num_waiting)
            one(self.kv_usage).set(stats.kv_cache_usage)
        one(self.iteration_tokens).observe(stats.num_batched_tokens)
        one(self.step_time).observe(stats.step_seconds)
        itl = one(self.itl)
        for latency in stats.inter_token_latencies:
            itl.observe(latency)

    def _one(self, metric):
        """`metric`'s child for this server's model name (prometheus_client's `labels` takes a
        lock and validates the labels at every call)."""
        child = self._children.get(metric)
        if child is None:
            child = self._children[metric] = metric.labels(self.model_name)
        return child

    def on_request_finished(self, stats: RequestStats) -> None:
        """Once per request, on the engine's thread when it finishes."""
        m = self.model_name
        self.success.labels(m, stats.finish_reason).inc()
        self.e2e.labels(m).observe(stats.e2e_seconds)
        self.prompt_len.labels(m).observe(stats.num_prompt_tokens)
        self.generation_len.labels(m).observe(stats.num_generation_tokens)
        self._observe(((self.ttft, stats.time_to_first_token),
                       (self.queue_time, stats.queue_seconds),
                       (self.prefill_time, stats.prefill_seconds),
                       (self.decode_time, stats.decode_seconds),
                       (self.inference_time, stats.inference_seconds),
                       (self.tpot, stats.time_per_output_token),
                       (self.front_time, stats.front_seconds),
                       (self.render_time, stats.render_seconds),
                       (self.tokenize_time, stats.tokenize_seconds)))

    def on_request_delivered(self, stats: DeliveryStats) -> None:
        """Once per served request, on the event loop after its response was written."""
        self._observe(((self.first_write_delay, stats.first_token_write_delay),
                       (self.last_write_delay, stats.last_token_write_delay),
                       (self.ttft_written, stats.time_to_first_token_written),
                       (self.first_token_overhead, stats.first_token_overhead)))

    def _observe(self, pairs) -> None:
        """(histogram, seconds) pairs; a span that is None (a stamp never taken) is skipped."""
        for histogram, value in pairs:
            if value is not None:
                self._one(histogram).observe(value)
