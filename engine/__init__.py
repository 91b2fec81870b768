"""specserve's inference engine: paged KV cache, continuous batching, speculative decoding."""

import os

# How OpenMP's workers wait between parallel regions; libgomp reads it once, when torch loads it.
# A decode step is about 120 parallel regions a few microseconds apart. Workers that sleep at once
# (OMP_WAIT_POLICY=PASSIVE) pay a futex wake-up at every one: half the decode speed (measured, 44
# vs 87 tok/s on 2 cores). libgomp's default spin of 300,000 rounds holds a core for milliseconds
# after the step ends, which the HTTP thread and other teams need (a 120 KB gather once took 1.4 ms
# instead of 30 us). A bounded spin covers the gaps inside a step and frees the core soon after.
# It helps one OpenMP team only: with a second team on 2 cores libgomp counts the machine as
# oversubscribed and spins about 100 rounds, so AsyncEngine loads and steps on one thread.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
