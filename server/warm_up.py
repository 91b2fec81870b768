"""What the server runs before it says it is ready (server/lifecycle.py): every one-time cost the
first requests would otherwise pay.

The engine has already made every padded step shape ready while it started (CUDA graphs, the
Triton attention kernel at every query length: engine/runner/static_runner.py). Here, through the
same doors a request takes:
- the chat template renders a sample conversation in its renderer process and the tokenizer
  encodes it (the chat route's path), and the engine's detokenizer decodes the reply;
- on a GPU, prompts at every prefill bucket (`prefill_lengths`: powers of four up to a whole
  chunk) and the sampler's paths (greedy, temperature with top-k/top-p and a seed, penalties and
  logprobs) run together, so each kernel, cuBLAS handle and lazily loaded CUDA module is met
  once. On a CPU nothing compiles at first use, and one chat request stays the whole warm-up
  (tests start many servers).

Once it ends the server marks its ready moment (engine/metrics/first_use.py): from then on a
graph captured, a step shape or a Triton kernel met for the first time is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.core.device import pick_device
from engine.sampling_params import SamplingParams
from server.context import ServerContext
from server.templates import SAMPLE_CONVERSATION

logger = logging.getLogger(__name__)

FALLBACK_PROMPT = "Warm-up."  # models without a chat template
CACHE_SALT = "specserve-warm-up"
SMALLEST_CHUNK = 4  # the first prefill bucket past a one-token prompt
# Each warm-up request's sampling: greedy, then the sampled paths (with a seed: no state is shared
# with later requests), penalties and logprobs.
SAMPLING_CASES = (
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 0},
    {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.5,
     "repetition_penalty": 1.1, "logprobs": 2, "seed": 1},
)


def prefill_lengths(max_chunk: int, max_prompt: int) -> list[int]:
    """Prompt lengths whose prefills cover the step shapes a prompt can take: 1, then powers of
    four up to a whole chunk (`max_chunk` tokens, the most one step computes), at most
    `max_prompt`."""
    top = min(max_chunk, max_prompt)
    lengths, n = [1], SMALLEST_CHUNK
    while n < top:
        lengths.append(n)
        n *= 4
    if top > 1:
        lengths.append(top)
    return lengths


def synthetic_prompt(length: int, seed: int, vocab_size: int, base: list[int]) -> list[int]:
    """`length` token ids no other warm-up prompt starts with (the prefix cache must not skip a
    prefill): `base` (real text's ids) shifted by `seed`, cycled."""
    return [(base[i % len(base)] + seed) % vocab_size for i in range(length)]


async def chat_prompt_ids(context: ServerContext) -> list[int]:
    """The sample conversation through the chat template's renderer and the tokenizer, as the
    chat route does them; the fallback prompt where the model has no template."""
    tokenizer = context.engine.tokenizer
    if context.templates is None:
        return tokenizer(FALLBACK_PROMPT)["input_ids"]
    text = await context.templates.render(tokenizer.get_chat_template(), SAMPLE_CONVERSATION,
                                          None, add_generation_prompt=True)
    return await asyncio.to_thread(lambda: tokenizer(text, add_special_tokens=False)["input_ids"])


async def _run(context: ServerContext, prompt_ids: list[int], params: SamplingParams,
               request_id: str) -> None:
    """One request through the engine, in a prefix-cache partition of its own: no client's
    prompt ever hits the warm-up's blocks (a test counting cache hits, a system prompt)."""
    request = context.engine.validate(prompt_ids, params, request_id, cache_salt=CACHE_SALT)
    async for _ in context.engine.generate(request):
        pass


async def warm_up(context: ServerContext) -> float:
    """Runs the warm-up; returns its seconds."""
    started = time.perf_counter()
    engine = context.engine
    prompt_ids = await chat_prompt_ids(context)
    await _run(context, prompt_ids, SamplingParams(max_tokens=2, temperature=0.0), "warm-up")
    if pick_device(engine.config.model.device).type == "cuda":
        limits = engine.limits
        lengths = prefill_lengths(engine.config.scheduler.max_num_batched_tokens,
                                  limits.max_model_len - 4)
        runs = []
        for i, length in enumerate(lengths):
            case = SAMPLING_CASES[i % len(SAMPLING_CASES)]
            ids = synthetic_prompt(length, 1 + i, engine.vocab_size, prompt_ids)
            runs.append(_run(context, ids, SamplingParams(max_tokens=3, ignore_eos=True, **case),
                             f"warm-up-{length}"))
        await asyncio.gather(*runs)
    seconds = time.perf_counter() - started
    logger.info("warm-up: %.2f s", seconds)
    return seconds
