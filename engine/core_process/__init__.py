"""The engine core in its own process (vLLM v1's split): `EngineCoreClient` is the API process's
side, with `AsyncEngine`'s interface; worker.py is the engine process's main loop; wire.py the
messages between them."""

from engine.core_process.client import EngineCoreClient
from engine.core_process.selection import ENGINE_CORE_CHOICES, engine_factory

__all__ = ["ENGINE_CORE_CHOICES", "EngineCoreClient", "engine_factory"]
