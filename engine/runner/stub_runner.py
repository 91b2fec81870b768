"""A benchmark-only flat runner whose forward costs nothing: it serves garbage tokens.

`benchmarks/host_ceiling.py` measures the whole server (scheduling, sampling, emit, detokenizing,
delivery to the event loop, SSE framing, the client) without the model's compute: that is the
most tokens a second the host can serve, which bounds what any device can reach behind it.

The stub never runs unless the environment says `SPECSERVE_BENCHMARK_STUB_FORWARD=1`; the engine
logs a warning when it does. Its logits are cheap and deterministic: each sampled row is a
near-one-hot (30 at one token, 0 elsewhere) on the token that follows the row's position in a
fixed English text, so sampling still runs on a `[num_logits, vocab]` tensor and the detokenizer
decodes ordinary words, spaces and punctuation, as it would for a model's reply. No KV is written.
The logits live in one buffer kept from step to step and zeroed in place (0.2 ms for 64 rows of a
49152-token vocabulary on an AMD EPYC Zen 4, against 1.4 ms for a fresh `torch.zeros`, whose pages
the kernel faults in anew each step). The stub runs on the CPU only: no step is in flight while
the next is built (overlapped steps are CUDA's), so one buffer serves, and the host's ceiling needs
no device (on a GPU machine, serve it with `--device cpu`).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.runner.model_runner import ModelInput, ModelRunner
from engine.runner.static_runner import uses_padded_steps

logger = logging.getLogger(__name__)

STUB_FORWARD_ENV = "SPECSERVE_BENCHMARK_STUB_FORWARD"
# The logit of the stub's token; every other logit is 0, so even at temperature 1 the token is
# drawn with probability 1 - vocab * e^-30 (and logprobs stay finite, as JSON needs).
STUB_LOGIT = 30.0
STUB_TEXT = (
    "The lighthouse keeper climbed the spiral stairs at dusk, as she had done every evening for "
    "thirty years. Her cat followed two steps behind, pausing at each window to watch the gulls. "
    "At the top she trimmed the wick, polished the great lens with a soft cloth, and wrote the "
    "weather in her log: wind from the west, a light swell, fog expected before midnight. Ships "
    "passed far out on the horizon, their lamps small and steady; she counted them, \"one, two, "
    "three\", and smiled when the last one turned toward the harbour. "
)


def stub_forward_requested() -> bool:
    """True only where the benchmark switch is set: never in a server started as usual."""
    return os.environ.get(STUB_FORWARD_ENV) == "1"


def flat_runner(config, loaded, kv_cache, device: torch.device) -> ModelRunner:
    """The engine's flat runner: the model's, or, under the benchmark switch, the stub.
    Raises ValueError for the stub with padded steps, which would still run the model."""
    if not stub_forward_requested():
        return ModelRunner(loaded.model, kv_cache, device)
    if device.type != "cpu" or uses_padded_steps(config, device):
        raise ValueError(f"{STUB_FORWARD_ENV}=1 replaces the flat CPU step only: serve with "
                         "--device cpu (padded CUDA-graph steps would still run the model)")
    logger.warning("%s=1: the model's forward is a stub that serves garbage tokens "
                   "(a benchmark of the host, never a real server)", STUB_FORWARD_ENV)
    return StubForwardRunner(loaded.model, kv_cache, device, loaded.tokenizer)


class StubForwardRunner(ModelRunner):
    """A ModelRunner whose `execute` returns zero hidden states and one-hot-like logits."""

    def __init__(self, model, kv_cache, device: torch.device, tokenizer):
        super().__init__(model, kv_cache, device)
        ids = tokenizer(STUB_TEXT, add_special_tokens=False)["input_ids"]
        self.text_token_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [len]
        self.vocab_size = model.lm_head.out_features
        self.hidden_size = model.arch.hidden_size
        self._logits: torch.Tensor | None = None  # [rows, vocab] float32, reused
        self._hidden: torch.Tensor | None = None  # [rows, hidden] zeros, reused as they are

    def stub_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        """The token the stub samples after each position: [len(positions)]."""
        return self.text_token_ids[(positions + 1) % self.text_token_ids.shape[0]]

    def execute(self, model_input: ModelInput, known_tokens: dict[int, int] | None = None,
                capture_features: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [num_tokens, hidden] zeros, logits [num_logits, vocab] float32). Rows whose
        token a grammar alone decides (`known_tokens`) get that token instead."""
        num_logits = model_input.num_logits
        tokens = self.stub_tokens(model_input.positions[model_input.logits_indices])
        if known_tokens:
            rows = torch.tensor(list(known_tokens), dtype=torch.long, device=self.device)
            forced = torch.tensor(list(known_tokens.values()), dtype=torch.long,
                                  device=self.device)
            tokens[rows] = forced.clamp(max=self.vocab_size - 1)
        logits = self._zeroed_logits(num_logits)
        logits[torch.arange(num_logits, device=self.device), tokens] = STUB_LOGIT
        if self._hidden is None or self._hidden.shape[0] < model_input.num_rows:
            self._hidden = torch.zeros((model_input.num_rows, self.hidden_size),
                                       device=self.device)
        return self._hidden[:model_input.num_rows], logits

    def _zeroed_logits(self, num_rows: int) -> torch.Tensor:
        """[num_rows, vocab] zeros in the reused buffer (grown where too small): zeroed in
        full, since the sampler or a grammar may have written into it."""
        if self._logits is None or self._logits.shape[0] < num_rows:
            self._logits = torch.zeros((num_rows, self.vocab_size), dtype=torch.float32,
                                       device=self.device)
        logits = self._logits[:num_rows]
        logits.zero_()
        return logits
