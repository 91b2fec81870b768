"""specserve's inference engine: paged KV cache, continuous batching, speculative decoding."""

import os

# On small CPU machines, OpenMP worker threads that spin-wait between parallel regions made every
# small tensor op cost milliseconds (measured: a 120 KB gather took 1.4 ms instead of 30 us).
# Passive waiting must be chosen before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
