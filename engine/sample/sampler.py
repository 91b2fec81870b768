"""Choosing the next token from logits: pure functions on tensors, batched, no state.

Order of operations, per row: grammar mask (disallowed tokens to -inf) -> logit bias -> repetition / frequency / presence penalties -> (greedy:
argmax) -> temperature -> top-k -> top-p -> min-p -> sample. Seeded rows draw their randomness from
a generator seeded by (seed, output position), so a request's tokens do not depend on what else is
in the batch or on whether it was preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.device import copy_to_device, to_device
from engine.grammar.masks import mask_logits
from engine.quant.kernels import cpu_ops_for
from engine.sampling_params import SamplingParams


class TokenHistory(Sequence):
    """A row's generated tokens: the request's output, then the first `num_drafts` of its drafts,
    without copying them. Every verified row of every request needs one each step, and only
    penalties read the tokens (seeded generators read the length): copying 2,000-token outputs
    for 16 requests x 6 rows cost ~0.5 ms a step."""

    __slots__ = ("output", "drafts", "num_drafts")

    def __init__(self, output: list[int], drafts: list[int], num_drafts: int):
        self.output, self.drafts, self.num_drafts = output, drafts, num_drafts

    def __len__(self) -> int:
        return len(self.output) + self.num_drafts

    def __iter__(self):
        yield from self.output
        yield from self.drafts[:self.num_drafts]

    def __getitem__(self, index):
        return list(self)[index]


@dataclass
class SamplingBatch:
    """Per-row settings for the rows of a logits tensor (one row per token to be chosen)."""

    temperature: torch.Tensor  # [num_rows] float; 0 for greedy rows
    top_k: torch.Tensor  # [num_rows] long; vocab size where disabled
    top_p: torch.Tensor  # [num_rows] float; 1.0 where disabled
    min_p: torch.Tensor  # [num_rows] float; 0.0 where disabled
    generators: list[torch.Generator | None]  # per row; None: the shared random stream
    penalties: "Penalties | None" = None
    logit_bias: "LogitBias | None" = None
    all_greedy: bool = False
    any_greedy: bool = False
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    max_num_logprobs: int | None = None  # None: no row wants logprobs
    bitmask: torch.Tensor | None = None  # [num_rows, words] int32 (host): a grammar's tokens; None: all


@dataclass
class Penalties:
    presence: torch.Tensor  # [num_rows]
    frequency: torch.Tensor  # [num_rows]
    repetition: torch.Tensor  # [num_rows]
    output_counts: torch.Tensor  # [num_rows, vocab] how often each token was generated
    seen_mask: torch.Tensor  # [num_rows, vocab] bool: token in prompt or output


@dataclass
class LogitBias:
    rows: torch.Tensor  # [num_biases] long
    token_ids: torch.Tensor  # [num_biases] long
    values: torch.Tensor  # [num_biases] float


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] long
    logprobs: torch.Tensor | None  # [num_rows] float: log-probability of the chosen token
    top_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float
    top_token_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] long


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on the request's seed and the output position it samples."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + position) % (2**63))
    return generator


def build_sampling_batch(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
    shared_generator: torch.Generator | None = None,
    seed_offset: int = 0,
) -> SamplingBatch:
    """Turns each row's settings and token history into tensors. `seed_offset` gives seeded rows
    a stream of their own (a draft model's draws must be independent of the target's)."""
    def column(values, dtype):  # built on the host, sent without waiting
        return to_device(torch.tensor(values, dtype=dtype), device)

    generators = [
        seeded_generator(p.seed + seed_offset, len(out), device) if p.seed is not None
        else shared_generator
        for p, out in zip(params, output_token_ids)
    ]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    greedy = [p.greedy for p in params]
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    # The float settings travel in one copy (one pinned staging and one transfer, not three).
    floats = column([[p.temperature for p in params], [p.top_p for p in params],
                     [p.min_p for p in params]], torch.float32)
    batch = SamplingBatch(
        temperature=floats[0],
        top_k=column(top_k, torch.long),
        top_p=floats[1],
        min_p=floats[2],
        generators=generators,
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        use_top_k=any(k < vocab_size for k in top_k),
        use_top_p=any(p.top_p < 1 for p in params),
        use_min_p=any(p.min_p > 0 for p in params),
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
    )
    if any(p.needs_penalties for p in params):
        batch.penalties = _build_penalties(params, prompt_token_ids, output_token_ids,
                                           vocab_size, device)
    if any(p.logit_bias for p in params):
        entries = [(row, tok, val) for row, p in enumerate(params)
                   for tok, val in (p.logit_bias or {}).items()]
        rows, toks, vals = zip(*entries)
        batch.logit_bias = LogitBias(column(rows, torch.long), column(toks, torch.long),
                                     column(vals, torch.float32))
    return batch


def _build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device) -> Penalties:
    """Token counts as flat (row * vocab + token) indices built on the host: one copy to the
    device for the whole batch, not one per row."""
    num_rows = len(params)
    generated: list[int] = []
    seen: list[int] = []
    for row, (prompt, output) in enumerate(zip(prompt_token_ids, output_token_ids)):
        generated.extend(row * vocab_size + t for t in output)
        if params[row].repetition_penalty != 1:
            seen.extend(row * vocab_size + t for t in prompt)
    generated_t, seen_t = copy_to_device(
        [torch.tensor(generated, dtype=torch.long), torch.tensor(seen, dtype=torch.long)], device)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.index_add_(0, generated_t, torch.ones(len(generated), device=device))
    seen_mask = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=device)
    seen_mask.index_fill_(0, seen_t, True).index_fill_(0, generated_t, True)
    settings = to_device(torch.tensor(
        [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
        dtype=torch.float32), device)
    return Penalties(
        presence=settings[:, 0], frequency=settings[:, 1], repetition=settings[:, 2],
        output_counts=counts.view(num_rows, vocab_size),
        seen_mask=seen_mask.view(num_rows, vocab_size),
    )


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty (divides positive logits, multiplies negative ones, of seen tokens),
    then OpenAI's frequency and presence penalties on generated tokens."""
    repetition = penalties.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.seen_mask, penalized, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * penalties.output_counts
    return logits - penalties.presence.unsqueeze(1) * (penalties.output_counts > 0).float()


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks (to -inf) the tokens outside each row's top-k, nucleus (top-p) and min-p sets."""
    if batch.use_top_k or batch.use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        drop = ranks >= batch.top_k.unsqueeze(1)
        if batch.use_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep a token while the mass of the tokens ranked above it is below top_p. Rows with
            # top_p disabled are exempt: float32 cumsums reach 1.0 before the tail ends.
            mass_before = probs.cumsum(dim=-1) - probs
            top_p = batch.top_p.unsqueeze(1)
            drop |= (mass_before >= top_p) & (top_p < 1)
        drop[:, 0] = False  # the most likely token always survives
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if batch.use_min_p:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a non-greedy row samples from, after temperature and the filters.

    Greedy rows get temperature 1 here; callers use argmax for them.
    """
    temperature = torch.where(batch.temperature > 0, batch.temperature,
                              torch.ones_like(batch.temperature))
    logits = logits / temperature.unsqueeze(1)
    return apply_top_k_top_p_min_p(logits, batch).softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: list) -> torch.Tensor:  # [num_rows]
    """Draws one token per row from its own generator: one uniform each (`row_uniforms`), then
    `draw_tokens`."""
    return draw_tokens(probs, row_uniforms(generators, probs.device))


def row_uniforms(generators: list, device: torch.device) -> torch.Tensor:  # [len(generators)]
    """One uniform draw in [0, 1) per generator, in order (None: the default stream), as
    float64."""
    out = torch.empty(len(generators), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        out[i:i + 1].uniform_(generator=generator)
    return out


def draw_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [...]
    """The inverse-CDF draw of each row of probs [..., vocab] with u [...] in [0, 1): the first
    token whose cumulative probability exceeds u x the row's total. One uniform a row, where the
    exponential race (argmax p / E) drew one exponential per token: on CPU that was ~1.1 ms of
    a 49,152-token row, a fifth of a batch-1 decode step and 40% of a 16-row one. The sums are
    float64, so a tail of tiny probabilities still moves them (float32 would stop at ~6e-8 a
    token past a total near 1). A token of probability 0 is never drawn: the threshold stays
    below the total, and a zero adds nothing to the sum."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[..., -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    threshold = torch.minimum(u.unsqueeze(-1) * total, below_total)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1), the same indices (ties to the first, NaN first), through the CPU
    extension's vector loop where it applies: torch's reduction takes ~90 us a 49,152-token row,
    a fiftieth of a decode step, per row."""
    fused = cpu_ops_for(x)
    if fused is None or x.dim() == 0 or x.numel() == 0:
        return x.argmax(dim=-1)
    return fused.argmax_rows(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Grammar mask, logit bias, then penalties: what greedy rows take the argmax of. Masked
    tokens stay at -inf through bias and penalties, so every later step sees the masked
    distribution."""
    if batch.bitmask is not None:
        # Logprobs are of the raw logits (read after this); without them, nothing reads them.
        logits = mask_logits(logits, batch.bitmask, in_place=batch.max_num_logprobs is None)
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def choose_tokens(processed_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row from processed logits: argmax for greedy rows, a draw otherwise."""
    greedy_ids = argmax_rows(processed_logits) if batch.any_greedy else None
    if batch.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(target_probs(processed_logits, batch), batch.generators)
    if greedy_ids is None:
        return sampled
    return torch.where(batch.temperature == 0, greedy_ids, sampled)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [num_rows, vocab] (float32, raw from the model) -> one token per row."""
    token_ids = choose_tokens(process_logits(logits, batch), batch)
    return compute_logprobs(logits, token_ids, batch.max_num_logprobs)


def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     max_num_logprobs: int | None) -> SamplerOutput:
    """Log-probabilities are those of the model's raw distribution (as vLLM reports them)."""
    if max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = raw_logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(max_num_logprobs, dim=-1) if max_num_logprobs > 0 else None
    return SamplerOutput(
        token_ids, chosen,
        top.values if top is not None else None,
        top.indices if top is not None else None,
    )
