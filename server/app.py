"""The HTTP application: OpenAI-compatible routes in front of one AsyncEngine.

The model loads in a worker thread while the app starts; the engine's steps run in its own thread,
so the event loop only parses, streams and answers `/health`, `/ready` and `/metrics` at any load.
Probes and the graceful drain live in `server/lifecycle.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import Response

from engine import EngineConfig
from engine.core_process import engine_factory
from engine.metrics.stat_logger import PeriodicStatLogger
from server import chat, completions, metrics, tokenize
from server.connections import AcceptErrorLog
from server.context import (
    Admission,
    ServerContext,
    ServerSettings,
    get_context,
    require_api_key,
)
from server.errors import APIError, install_error_handlers
from server.lifecycle import Lifecycle
from server.limits import BodySizeLimitMiddleware
from server.loop_lag import LoopLagMonitor, freeze_startup_objects
from server.protocol import ModelCard, ModelList
from server.responses import routes as responses_routes
from server.responses.store import ResponseStore, default_path
from server.templates import ChatTemplates, TemplateLimitError

VERSION = "0.1.0"
logger = logging.getLogger(__name__)

__all__ = ["VERSION", "ServerSettings", "build_app"]


def build_app(engine_config: EngineConfig, settings: ServerSettings = ServerSettings(),
              engine_core: str = "auto") -> FastAPI:
    """`/health` (liveness) and `/ready` (readiness) answer 503 until the engine has loaded and
    run its warm-up step; `app.state.lifecycle` drains the server (see `server.lifecycle`).
    `engine_core`: "thread", "process" or "auto" (engine/core_process/selection.py)."""

    server_metrics = metrics.ServerMetrics(settings.metrics_prefix)
    lifecycle = Lifecycle(settings)
    lifecycle.render_metrics = server_metrics.render
    loop_lag = LoopLagMonitor(server_metrics.registry, settings.metrics_prefix)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        try:
            engine = await asyncio.to_thread(engine_factory(engine_core, engine_config))
        except ValueError as error:
            # What the engine found wrong at start: the GPU memory share does not fit, a flag
            # that does not suit the model.
            _exit_with(str(error), 1)
        context = ServerContext(engine, settings.served_model_name or engine.model_name,
                                settings, Admission(settings.max_queue,
                                          settings.max_completions_per_request))
        context.templates = await _start_templates(engine.tokenizer, settings)
        context.response_store = await asyncio.to_thread(_open_response_store, settings)
        await lifecycle.start(context)  # before the metrics listeners: warm-up is not traffic
        server_metrics.attach_engine(context)
        context.server_metrics = server_metrics
        engine.add_stat_listener(PeriodicStatLogger())
        app.state.context = context
        freeze_startup_objects()
        loop_lag.start()
        yield
        await loop_lag.stop()
        if context.templates is not None:
            await context.templates.close()
        context.response_store.close()
        context.grammar_gate.close()
        engine.shutdown()

    app = FastAPI(title="specserve", version=VERSION, lifespan=lifespan)
    app.state.context = None
    app.state.lifecycle = lifecycle
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    # Outermost, so refused bodies (413) are counted too.
    app.add_middleware(metrics.HTTPMetricsMiddleware, counter=server_metrics.http_requests)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses_routes.router)
    app.include_router(tokenize.router)

    @app.get("/health")
    async def health():
        return lifecycle.liveness().response()

    @app.get("/ready")
    async def ready():
        return lifecycle.readiness().response()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(server_metrics.render(), media_type=metrics.CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models(context: ServerContext = Depends(get_context)):
        return ModelList(data=[_model_card(context)])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def retrieve_model(model_id: str, context: ServerContext = Depends(get_context)):
        if model_id != context.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return _model_card(context)

    return app


async def _start_templates(tokenizer, settings: ServerSettings) -> ChatTemplates | None:
    """The renderer pool for the chat template (--chat-template's, else the model's), checked on
    a sample conversation: a template that breaks its limits there would break them for every
    request, so the server refuses to start, in one line, exit 2."""
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template
    if not getattr(tokenizer, "chat_template", None):
        return None
    templates = ChatTemplates(dict(tokenizer.special_tokens_map), settings.template_limits)
    await templates.start()
    try:
        await templates.check(tokenizer.get_chat_template())
    except TemplateLimitError as error:
        await templates.close()
        _exit_with(f"the chat template {error} on a sample conversation", 2)
    return templates


def _open_response_store(settings: ServerSettings) -> ResponseStore:
    """--response-store's file; one that cannot be opened stops the server. The default file
    (in the cache folder, which may be read-only in a container) falls back to memory, said in
    the log."""
    path = settings.response_store or default_path()
    max_bytes = int(settings.response_store_max_mb * 1024 * 1024)
    try:
        return ResponseStore(path, max_bytes)
    except Exception as error:  # sqlite3.Error, OSError: a path that cannot be a database
        if settings.response_store is not None:
            _exit_with(f"--response-store {path}: {error}", 2)
        logger.warning("stored responses kept in memory only: cannot open %s (%s); set "
                       "--response-store", path, error)
        return ResponseStore(":memory:", max_bytes)


def _exit_with(message: str, status: int) -> None:
    """One line, as the CLI's own checks print, not uvicorn's traceback of a failed lifespan."""
    sys.stderr.write(f"specserve: error: {message}\n")
    sys.stderr.flush()
    os._exit(status)


def _model_card(context: ServerContext) -> ModelCard:
    return ModelCard(id=context.model_name, created=context.created,
                     max_model_len=context.max_model_len)
