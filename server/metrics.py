"""`GET /metrics`: one registry per app holding the engine's Prometheus metrics
(`engine/metrics/prometheus.py`), the HTTP layer's request counter and what only the server knows (its
admission queue, the KV pool's size), all named `<prefix>:<name>` like vLLM's.

The engine's counters and histograms are fed on the engine thread by its stat listener; gauges are
read at scrape time. Each scrape read (a queue's length, a free-block count) is one atomic operation
under the GIL, so a scrape never waits for an engine step.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.metrics.first_use import FirstUseCollector
from engine.metrics.prometheus import PrometheusMetrics
from engine.metrics.suffix_gauges import SuffixCacheCollector
from server.context import ServerContext
from server.timeline import stamp_arrival

__all__ = ["CONTENT_TYPE_LATEST", "HTTPMetricsMiddleware", "ServerMetrics"]


class ServerMetrics:
    """Exists from app creation (the HTTP counter); the engine's metrics join once it loads."""

    def __init__(self, prefix: str = "specserve"):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes and friends (unprefixed, as vLLM exports them): memory
        # sizing and leak checks read them.
        ProcessCollector(registry=self.registry)
        # No model_name label: the HTTP layer is shared by whatever the server serves.
        self.http_requests = Counter(f"{prefix}:http_requests", "HTTP requests by route "
                                     "template and status", ["route", "status"],
                                     registry=self.registry)
        self.structured_requests = Counter(
            f"{prefix}:structured_requests", "Requests with a structured output or tools, by "
            "kind (json_schema, json_object, regex, choice, grammar, tools_auto, "
            "tools_required, tools_named)", ["kind"], registry=self.registry)
        self.grammar_compile_time = Histogram(
            f"{prefix}:grammar_compile_seconds", "Time to compile (or find cached) a request's "
            "grammar, off the event loop", registry=self.registry,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
        # The engine's metrics, once attached; the routes report what only they see (when a
        # response's bytes were written) through it, so one object observes a request's spans.
        self.engine_metrics: PrometheusMetrics | None = None

    def record_structured(self, kind: str, compile_seconds: float | None) -> None:
        self.structured_requests.labels(kind).inc()
        if compile_seconds is not None:
            self.grammar_compile_time.observe(compile_seconds)

    def attach_engine(self, context: ServerContext) -> None:
        """Registers the engine's metrics as its stat listener: call once, before serving."""
        engine = context.engine
        speculative = engine.config.speculative
        engine_metrics = PrometheusMetrics(
            context.model_name, self.registry, self.prefix, engine_state=engine.load,
            num_speculative_tokens=speculative.num_speculative_tokens
            if speculative.enabled else 0)
        engine.add_stat_listener(engine_metrics)
        self.engine_metrics = engine_metrics
        self.registry.register(_ServerCollector(context, self.prefix))
        self.registry.register(FirstUseCollector(context.model_name, self.prefix))
        if engine.suffix_cache_stats() is not None:
            self.registry.register(SuffixCacheCollector(context.model_name, self.prefix,
                                                        engine.suffix_cache_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServerCollector(Collector):
    def __init__(self, context: ServerContext, prefix: str):
        self.context = context
        self.prefix = prefix

    def collect(self):
        free_blocks, num_blocks = self.context.engine.kv_blocks()
        gauges = [
            ("num_requests_queued", "Accepted requests without a first token yet (503 past "
             "--max-queue)", self.context.admission.num_waiting),
            ("kv_cache_free_blocks", "KV blocks free or holding evictable cached prefixes",
             free_blocks),
            ("kv_cache_num_blocks", "KV blocks in the cache", num_blocks),
        ]
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(f"{self.prefix}:{name}", documentation,
                                      labels=["model_name"])
            gauge.add_metric([self.context.model_name], value)
            yield gauge


class HTTPMetricsMiddleware:
    """Counts every HTTP request by its route template (`/v1/models/{model_id:path}`, not the
    raw path, so the label set stays small) and response status, and stamps its arrival. A plain ASGI middleware:
    it passes `receive` through untouched, so disconnect detection keeps working."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stamp_arrival(scope)  # the request's timeline starts here (server/timeline.py)
        status = 500  # what the client sees when the app fails before responding

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.counter.labels(route, str(status)).inc()
