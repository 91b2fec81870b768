"""Decode and verify steps over persistent buffers, padded to fixed shapes; CUDA graphs on GPU.

A step in which every request feeds at most `max_query_len` tokens (its last token, plus its
drafts when verifying) is laid out uniformly: `num_seqs` rows of `query_len` tokens, the batch
padded up to a bucket, block tables cut to a bucketed width. Inputs are written into buffers
that live as long as the engine, so the same tensors feed every step of a shape, and on CUDA the
whole forward for one shape is captured once as a graph and replayed: one launch instead of ~50
kernels per layer. Every shape a step can take (every batch bucket up to max_num_seqs, query
length and table width) is captured when the engine starts, as vLLM does, so no request waits for
a capture while serving; a shape first met later is counted (engine/metrics/first_use.py). On CPU
the same layout runs eagerly (the buffers, buckets and padding are what the tests see); graphs
are CUDA-only and `--enforce-eager` turns them off (each shape then runs once at start).

Padding rows feed token 0 and write their KV into a scratch block past the ones the block
manager hands out, so they never touch a request's cache; their logits are never read.
"""

from __future__ import annotations

import array
import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import triton_backend
from engine.attention.metadata import AttentionMetadata, BatchedGroup
from engine.config import EngineConfig, EngineLimits
from engine.core.device import StagedCopy
from engine.core.scheduler import ScheduledRequest
from engine.runner.cuda_graphs import StepGraphs
from engine.runner.padded_inputs import InputRegions, padded_inputs
from engine.runner.padded_settings import skipped_warm_batches
# engine/engine.py imports it from here
from engine.runner.padded_settings import uses_padded_steps  # noqa: F401
from engine.sample.sampler import argmax_rows

# Batch sizes a padded step is rounded up to, as vLLM captures them: each of 1, 2 and 4, then every
# 8 up to 256 and every 16 up to 512 (past it, max_num_seqs itself). Steps of 8 waste at most 7
# padding rows; the coarser list before (..., 32, 48, 64, 96, ...) padded 65 requests to 96.
BATCH_BUCKETS = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
# Verify steps of at most this many padded rows run the LM head inside their graph, as decode
# steps do: on an H100 the head outside a graph cost a speculative step 0.13-0.20 ms of host
# launches (docs/gpu.md). Each such graph keeps its [rows, vocab] float32 logits (12.6 MB at 64
# rows of a 49,152-token vocabulary); wider verify steps keep the head outside, on the wanted
# rows only.
MAX_VERIFY_ROWS_WITH_HEAD = 64


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding n (n itself past the largest)."""
    index = bisect.bisect_left(buckets, n)
    return buckets[index] if index < len(buckets) else n


def power_of_two_bucket(n: int, cap: int) -> int:
    """The next power of two, at most `cap`: block-table widths and query lengths take few
    values, so few shapes (and graphs) cover every step."""
    return min(1 << max(n - 1, 0).bit_length(), cap)


@dataclass(frozen=True)
class StepShape:
    num_seqs: int  # bucketed
    query_len: int  # tokens per sequence (a power of two, or the most a step feeds)
    width: int  # block-table width in blocks (a power of two, or the longest table)


@dataclass
class StaticStep:
    """A prepared step: its shape, the padded rows whose logits are wanted, and (as in
    `ModelInput`) which scheduled requests sample and where their rows start in `run`'s logits."""

    shape: StepShape
    logits_rows: torch.Tensor  # [num_logits] rows of the padded layout to sample from
    logits_owners: list[int]
    logits_row_starts: list[int]
    token_row_starts: list[int]  # per scheduled request, its first row in the padded layout
    argmax_in_graph: bool = False  # set by `run`: its graph left each row's argmax in `sampled`

    @property
    def num_rows(self) -> int:
        """Rows the forward computes, padding included: what the step costs."""
        return self.shape.num_seqs * self.shape.query_len

    @property
    def num_logits(self) -> int:
        return self.logits_rows.shape[0]


class StaticStepRunner:
    @classmethod
    def for_engine(cls, config: EngineConfig, model, kv_cache, limits: EngineLimits,
                   device: torch.device, attention_backend: str) -> "StaticStepRunner":
        """The runner of an engine whose KV cache holds one scratch block past the
        `limits.num_kv_blocks` the block manager hands out."""
        spec = config.speculative
        return cls(model, kv_cache, limits.block_size, scratch_block=limits.num_kv_blocks,
                   max_num_seqs=config.scheduler.max_num_seqs,
                   max_query_len=1 + (spec.num_speculative_tokens if spec.enabled else 0),
                   max_model_len=limits.max_model_len, device=device,
                   use_graphs=not config.model.enforce_eager,
                   # The Triton kernel walks each request's own blocks: the table's width costs
                   # nothing there, so one width serves every step (fewer shapes, fewer graphs).
                   full_width_tables=attention_backend == "triton",
                   warm_attention_kernel=attention_backend == "triton")

    def __init__(self, model, kv_cache, block_size: int, scratch_block: int, max_num_seqs: int,
                 max_query_len: int, max_model_len: int, device: torch.device,
                 use_graphs: bool, full_width_tables: bool = False,
                 warm_attention_kernel: bool = False):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.warm_attention_kernel = warm_attention_kernel
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_num_seqs) + (max_num_seqs,)
        self.max_seqs = self.buckets[-1]
        self.max_query_len = max_query_len
        self.max_blocks = -(-max_model_len // block_size)
        self.full_width_tables = full_width_tables
        max_tokens = self.max_seqs * max_query_len

        # The persistent inputs: every step of a shape reads these same tensors, views of one
        # buffer that one scatter a step writes (padded_inputs.py). A row's token is gathered
        # from the token sources at `feed_index`: the host's id in `input_ids`, or, for a token
        # still in flight (overlapped steps, overlap.py), the previous step's sampled token in
        # `sampled`, without the host waiting for it.
        regions = self.regions = InputRegions.for_sizes(self.max_seqs, max_tokens,
                                                        self.max_blocks)
        self._inputs = torch.zeros(regions.total, dtype=torch.long, device=device)
        view = {name: self._inputs[regions.start[name]:regions.start[name] + n]
                for name, n in regions.size.items()}
        self._token_sources = self._inputs[:regions.start["feed"]]
        self.sampled = view["sampled"]  # a decode step's argmax per row
        self.input_ids, self.feed_index = view["input_ids"], view["feed"]
        self.positions, self.slot_mapping = view["positions"], view["slots"]
        self.query_lens, self.context_lens = view["query_lens"], view["context_lens"]
        self.block_tables = view["tables"].view(self.max_seqs, self.max_blocks)
        self.fed_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._rows = torch.arange(max_tokens, device=device)
        self._staged = StagedCopy(device)
        self.graphs = StepGraphs(self._forward, device, use_graphs)

    def graph_shapes(self) -> list[StepShape]:
        """Every shape `prepare` can produce: batch buckets x query lengths x table widths,
        narrowest tables first."""
        query_lens = sorted({power_of_two_bucket(n, self.max_query_len)
                             for n in range(1, self.max_query_len + 1)})
        widths = [self.max_blocks] if self.full_width_tables else sorted(
            {power_of_two_bucket(n, self.max_blocks) for n in range(1, self.max_blocks + 1)})
        return [StepShape(b, q, w) for w in widths for q in query_lens for b in self.buckets]

    def capture_graphs(self) -> int:
        """Makes every shape a step can take ready before the first request, widest first
        (cuda_graphs.py `warm`: captured, run once where graphs are off on CUDA, recorded on a
        CPU), and builds the Triton attention kernel at every query length a flat step may give
        it; returns how many graphs were captured. Nothing is left to first use: a shape met
        later is counted (engine/metrics/first_use.py)."""
        # The buffers hold a padding step: the warm-up runs write the scratch block only.
        self.input_ids.zero_()
        self.feed_index.copy_(self._rows + self.max_seqs)
        self.positions.zero_()
        self.slot_mapping.fill_(self.scratch_slot)
        self.block_tables.zero_()
        self.query_lens.fill_(1)
        self.context_lens.fill_(1)
        skipped = skipped_warm_batches()
        shapes = [shape for shape in self.graph_shapes() if shape.num_seqs not in skipped]
        num_graphs = self.graphs.warm(shapes[::-1])
        if self.warm_attention_kernel and self.model is not None:
            k_cache, v_cache = self.kv_cache[0]
            triton_backend.warm(k_cache, v_cache, self.model.arch.num_heads)
        return num_graphs

    def fits(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Decode/verify steps only: each request feeds its one new token plus drafts."""
        return (0 < len(scheduled) <= self.max_seqs
                and all(s.num_new_tokens == 1 and s.num_fed_tokens <= self.max_query_len
                        for s in scheduled))

    def padded_tokens(self, num_seqs: int, depth: int) -> int:
        """Rows a padded step of `num_seqs` requests computes when its longest request feeds
        `depth` draft tokens: what it costs, whoever drafts."""
        return bucket_for(num_seqs, self.buckets) * power_of_two_bucket(1 + depth,
                                                                        self.max_query_len)

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                in_flight: dict[int, int] | None = None) -> StaticStep:
        """Writes the step's inputs into the persistent buffers (one non-blocking copy).
        `in_flight` {id(request): row of `sampled`}: requests whose fed token is the previous
        step's, not yet read by the host; their row takes it from `sampled` on the device.

        The layout is built in plain Python lists and becomes one host tensor: at 64 requests,
        a few small tensors per request cost ~9 ms of host time per step (measured on CPU),
        more than a graph-replayed step takes on a GPU."""
        fed = [s.num_fed_tokens for s in scheduled]
        ends = [s.request.num_computed_tokens + n for s, n in zip(scheduled, fed)]
        shape = StepShape(bucket_for(len(scheduled), self.buckets),
                          power_of_two_bucket(max(fed), self.max_query_len),
                          self.max_blocks if self.full_width_tables
                          else power_of_two_bucket(-(-max(ends) // self.block_size),
                                                   self.max_blocks))
        inputs = padded_inputs(scheduled, shape.num_seqs, shape.query_len, self.regions,
                               self.block_size, self.scratch_slot, in_flight)
        fields = (inputs.values, inputs.places, inputs.logits_rows)
        host = array.array("q", inputs.values)  # a C array: 2-3x faster than torch.tensor(list)
        host.extend(inputs.places)
        host.extend(inputs.logits_rows)
        host = torch.frombuffer(host, dtype=torch.long)  # shares the array's memory, keeps it
        values, places, rows = self._staged.send([host])[0].split([len(f) for f in fields])
        if not self.full_width_tables:  # the torch backend gathers every block of the width
            self.block_tables[:shape.num_seqs, :shape.width].zero_()
        self._inputs.index_copy_(0, places, values)
        return StaticStep(shape, rows, inputs.logits_owners, inputs.logits_row_starts,
                          [i * shape.query_len for i in range(len(scheduled))])

    def row_cost(self, num_seqs: int):
        """`padded_tokens` of a step of `num_seqs` requests: rows as a function of the deepest
        request's drafts."""
        return functools.partial(self.padded_tokens, num_seqs)

    def run(self, step: StaticStep, known_tokens: dict[int, int] | None = None,
            capture_features: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of the padded layout, logits [num_logits, vocab] float32), both
        possibly a graph's output buffers: valid until the next step. `known_tokens` and
        `capture_features` are ignored: a graph computes every row's logits, and keeps the
        feature layers it was captured with."""
        hidden, logits = self.graphs.run(step.shape)
        step.argmax_in_graph = logits is not None and step.shape.query_len == 1
        if logits is None:
            # Outside a graph the LM head runs on the wanted rows only: padding rows and drafts
            # past a request's own cost no head matmul (on a CPU, ~0.5 ms a row).
            return hidden, self.model.logits(hidden, step.logits_rows)
        if step.num_logits == len(step.token_row_starts):  # every row samples, in order
            return hidden, logits[:step.num_logits]
        return hidden, logits.index_select(0, step.logits_rows)

    def feed_in_flight(self, step: StaticStep, tokens: torch.Tensor) -> None:
        """Puts the tokens in flight where `prepare` pointed their rows: in `sampled`, where a
        greedy step's graph already left them (the sampler's tokens are copied in)."""
        if tokens.data_ptr() != self.sampled.data_ptr():
            self.sampled[:tokens.shape[0]].copy_(tokens)

    def greedy_tokens(self, step: StaticStep, logits: torch.Tensor) -> torch.Tensor | None:
        """A decode step's argmax per sampling request (in `logits_owners` order), left in
        `sampled` on the device (where the next step feeds from): computed by its graph, or
        here from `run`'s logits. None for a verify step, or where a request does not sample."""
        if step.shape.query_len != 1 or step.num_logits != len(step.token_row_starts):
            return None
        if not step.argmax_in_graph:
            self.sampled[:step.num_logits].copy_(argmax_rows(logits))
        return self.sampled[:step.num_logits]

    def _forward(self, shape: StepShape, graphed: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [num_seqs * query_len, hidden], and in a graph every row's logits
        [num_seqs * query_len, vocab] float32, for a decode step with their argmax written to
        `sampled`): there the LM head (and a decode step's greedy choice) run inside the graph,
        which saves their host launches every step. A verify step wider than
        MAX_VERIFY_ROWS_WITH_HEAD leaves the head out."""
        n_tok = shape.num_seqs * shape.query_len
        rows = self._rows[:n_tok]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n_tok],
            batched=BatchedGroup(
                token_index=rows.view(shape.num_seqs, shape.query_len),
                real_rows=rows, real_token_index=rows,
                # contiguous: a copy of the buffer's current rows (inside a graph too)
                block_tables=self.block_tables[:shape.num_seqs, :shape.width].contiguous(),
                query_lens=self.query_lens[:shape.num_seqs],
                context_lens=self.context_lens[:shape.num_seqs],
                num_seqs=shape.num_seqs, max_query_len=shape.query_len,
                block_size=self.block_size, identity_layout=True),
            chunks=[], block_size=self.block_size)
        ids = torch.index_select(self._token_sources, 0, self.feed_index[:n_tok],
                                 out=self.fed_ids[:n_tok])
        hidden = self.model.hidden_states(ids, self.positions[:n_tok], self.kv_cache, meta)
        decode = shape.query_len == 1
        if not graphed or (not decode and n_tok > MAX_VERIFY_ROWS_WITH_HEAD):
            return hidden, None
        logits = self.model.logits(hidden, rows)
        if decode:
            self.sampled[:n_tok].copy_(argmax_rows(logits))
        return hidden, logits
