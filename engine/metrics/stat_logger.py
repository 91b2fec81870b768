"""A log line every ~10 s while the engine is busy: throughput, queue, KV usage, speculation."""

from __future__ import annotations

import logging
import time

from engine.metrics.spec_stats import SpecStats
from engine.metrics.stats import RequestStats, StepStats

logger = logging.getLogger("specserve.stats")


class PeriodicStatLogger:
    """A stat listener (see `LLMEngine.add_stat_listener`)."""

    def __init__(self, interval_seconds: float = 10.0, clock=time.monotonic):
        self.interval = interval_seconds
        self.clock = clock
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._spec = SpecStats()

    def on_step(self, stats: StepStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generated_tokens += stats.num_generated_tokens
        self._spec.merge(stats.spec)
        now = self.clock()
        if now - self._since >= self.interval:
            logger.info(self.format_line(stats, now - self._since))
            self._reset(now)

    def on_request_finished(self, stats: RequestStats) -> None:
        pass

    def format_line(self, last: StepStats, seconds: float) -> str:
        line = (f"prompt {self._prompt_tokens / seconds:.1f} tok/s, generation "
                f"{self._generated_tokens / seconds:.1f} tok/s, running {last.num_running}, "
                f"waiting {last.num_waiting}, KV cache {100 * last.kv_cache_usage:.1f}%")
        if self._spec.num_drafts:
            line += (f", drafts accepted {100 * self._spec.acceptance_rate:.1f}%, mean acceptance "
                     f"length {self._spec.mean_acceptance_length:.2f}")
        return line
