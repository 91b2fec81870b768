"""The HTTP application: FastAPI routes in front of one AsyncEngine."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine import AsyncEngine, EngineConfig

VERSION = "0.1.0"


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None


def build_app(engine_config: EngineConfig, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The engine loads when the app starts (so `/health` answers 503 until then)."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        engine = await asyncio.to_thread(AsyncEngine.from_config, engine_config)
        state["engine"] = engine
        state["model_name"] = settings.served_model_name or engine.engine.model_name
        yield
        engine.shutdown()

    app = FastAPI(title="specserve", version=VERSION, lifespan=lifespan)

    @app.get("/health")
    async def health():
        engine = state.get("engine")
        if engine is None or not engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    return app
