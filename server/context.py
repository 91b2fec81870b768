"""What every route needs: the engine, the served model's name, the settings, the admission queue
and the API-key check."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request

from engine import AsyncEngine
from server.errors import SERVER_ERROR, APIError
from server.grammar_gate import GrammarGate
from server.templates import ChatTemplates, TemplateLimits

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_ENGINE_STEP_TIMEOUT_S = 60.0
DEFAULT_STREAM_STALL_TIMEOUT_S = 30.0
RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # engine requests waiting for their first token
    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S  # a stream nobody reads
    # Engine requests (prompts x n) one HTTP request may ask for; None: max_queue.
    max_completions_per_request: int | None = None
    metrics_prefix: str = "specserve"  # "vllm": dashboards built for vLLM work unchanged
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # in-flight requests' time after SIGTERM
    engine_step_timeout_s: float = DEFAULT_ENGINE_STEP_TIMEOUT_S  # a longer step fails /health
    chat_template: str | None = None  # replaces the model's own (--chat-template)
    template_limits: TemplateLimits = TemplateLimits()
    response_store: str | None = None  # SQLite file of stored responses; None: the cache's
    response_store_max_mb: float = 1024.0  # past this, the oldest stored responses go


class Admission:
    """Who gets in. Counts engine requests that were accepted but have not produced a token yet
    (waiting for a slot, or prefilling): at `max_queue` of them, new HTTP requests are refused
    with 503. Also holds every response still in flight (`in_flight`), which a graceful drain
    waits for after `close()` has turned new requests away.

    Touched only on the event loop, so plain counters and sets are exact.
    """

    def __init__(self, max_queue: int, max_per_request: int | None = None):
        self.max_queue = max_queue
        self.max_per_request = min(max_per_request or max_queue, max_queue)
        self.num_waiting = 0
        self.in_flight: set = set()  # FanOuts between admission and their aclose()
        self.closed = False

    @property
    def is_full(self) -> bool:
        return self.num_waiting >= self.max_queue

    def check_size(self, num_requests: int, what: str) -> None:
        """A 400, before any work, for a request that asks for more engine requests than one
        request may (`what` says how they were counted: "300 prompts x n=128")."""
        if num_requests > self.max_per_request:
            raise APIError(400, f"this request asks for {num_requests} completions ({what}); "
                           f"the server takes at most {self.max_per_request} per request",
                           param="n")

    def admit(self, holder, num_requests: int) -> None:
        """Lets `holder` (a FanOut of `num_requests` engine requests) in, or raises a 503 when
        they do not all fit in the queue's free room."""
        self.check_size(num_requests, "prompts x n")
        if self.closed:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           SERVER_ERROR, code="server_draining",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if self.num_waiting + num_requests > self.max_queue:
            raise APIError(503, f"the server is busy: {self.num_waiting} requests are already "
                           "waiting; retry shortly", SERVER_ERROR, code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.num_waiting += num_requests
        self.in_flight.add(holder)

    def release(self) -> None:
        """One admitted engine request has its first token (or ended without one)."""
        self.num_waiting -= 1

    def leave(self, holder) -> None:
        """`holder`'s response is over; idempotent."""
        self.in_flight.discard(holder)

    def close(self) -> None:
        """Turns every later request away with 503 `server_draining`."""
        self.closed = True


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    settings: ServerSettings
    admission: Admission
    created: int = field(default_factory=lambda: int(time.time()))
    server_metrics: object | None = None  # server.metrics.ServerMetrics, once serving
    templates: ChatTemplates | None = None  # None: the model has no chat template
    response_store: object | None = None  # server.responses.store.ResponseStore, once serving
    grammar_gate: GrammarGate = field(default_factory=GrammarGate)  # structured-output workers

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        """Prompt plus output tokens one request can hold: the context and the KV cache bound it."""
        limits = self.engine.limits
        return min(limits.max_model_len, limits.num_kv_blocks * limits.block_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")


def get_context(request: Request) -> ServerContext:
    context = getattr(request.app.state, "context", None)
    if context is None:
        raise APIError(503, "the model is still loading", SERVER_ERROR,
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return context


def require_api_key(request: Request) -> None:
    """FastAPI dependency of the /v1 routes: `Authorization: Bearer <key>` when a key is set."""
    expected = get_context(request).settings.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "You didn't provide an API key. Send it as `Authorization: Bearer "
                       "<key>`.", code="invalid_api_key")
    # Several keys: comma-separated. Each key's stored responses are its own.
    token = token.strip().encode()
    if not any([hmac.compare_digest(token, key.strip().encode())
                for key in expected.split(",") if key.strip()]):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
