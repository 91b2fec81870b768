"""The synchronous engine: one `step()` schedules, runs the model, samples and reports.

Single-threaded by design: `AsyncEngine` drives it from one background thread, `LLM` from the
caller's thread.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from engine.attention import triton_backend
from engine.config import EngineConfig, EngineLimits
from engine.core.block_manager import BlockManager
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.device import (
    free_memory_bytes,
    is_resource_error,
    pick_device,
    pick_dtype,
    release_cached_memory,
)
from engine.core.intake import check_fits, check_prompt_ids
from engine.core.kv_cache import KVCache, bytes_per_block
from engine.core.memory import num_kv_blocks
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.distributed.launch import start_tensor_parallel
from engine.failures import describe, verify_step
from engine.faults import Faults
from engine.grammar import GrammarCompiler
from engine.grammar.masks import build_bitmask, known_next_tokens
from engine.metrics.stats import StepRecorder, request_stats
from engine.models.loader import load_model
from engine.emit import RequestState, build_output, emit
from engine.outputs import RequestOutput
from engine.runner import runner_for
from engine.runner.overlap import OverlappedSteps
from engine.runner.static_runner import StaticStepRunner, uses_padded_steps
from engine.runner.stub_runner import flat_runner
from engine.sampling_params import SamplingParams
from engine.spec_decode.factory import build_speculation
from engine.spec_decode.prefill_drafts import drafts_at_prefill
from engine.spec_decode.speculation import Speculation

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = pick_device(config.model.device)
        self.dtype = pick_dtype(config.model.dtype, self.device)
        release_cached_memory(self.device)
        free_at_start = free_memory_bytes(self.device)
        self.parallel = start_tensor_parallel(config, self.device)  # ranks 1..N-1, loading
        loaded = load_model(config.model.model, self.device, self.dtype,
                            quantization=config.model.quantization,
                            max_model_len=config.model.max_model_len,
                            shard=self.parallel and self.parallel.shard)
        self.model_name = loaded.name
        self.model_folder = loaded.folder
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model.arch.vocab_size,
                                        loaded.eos_token_ids)
        self.hf_config = loaded.hf_config
        arch = loaded.model.arch
        self.attention_backend = triton_backend.resolve(config.model.attention_backend,
                                                        self.device)
        loaded.model.set_attention_backend(self.attention_backend)
        if config.model.batch_invariant:
            loaded.model.use_batch_invariant_kernels(self.device, self.dtype,
                                                     self.attention_backend)
        fused_layers = loaded.model.use_fused_kernels(config.model.fused_kernels, self.device,
                                                      self.dtype)
        if fused_layers:
            logger.info("fused kernels: %d of %d layers", fused_layers, arch.num_layers)
        if self.parallel is not None:  # before the first call into the model
            self.parallel.follow(loaded.model)
        self.vocab_size = arch.vocab_size
        max_model_len = min(config.model.max_model_len or arch.max_position_embeddings,
                            arch.max_position_embeddings)
        self.limits = EngineLimits(
            num_kv_blocks=num_kv_blocks(config, loaded.model, self.dtype, self.device,
                                        free_at_start, max_model_len),
            block_size=config.cache.block_size, max_model_len=max_model_len)
        padded = uses_padded_steps(config, self.device) and self.parallel is None  # TP: no graphs
        # Padded steps write their padding rows' KV into one scratch block past the manager's.
        kv_cache = KVCache(loaded.model.kv_arch, self.limits.num_kv_blocks + int(padded),
                           self.limits.block_size, self.dtype, self.device)
        if self.parallel is not None:  # the other ranks build theirs of as many blocks
            self.parallel.mirror.set_main_cache(kv_cache)
        self.runner = flat_runner(config, loaded, kv_cache, self.device)  # stub: benchmarks
        self.static_runner = StaticStepRunner.for_engine(
            config, loaded.model, kv_cache, self.limits, self.device, self.attention_backend) \
            if padded else None
        self.block_manager = BlockManager(self.limits.num_kv_blocks, self.limits.block_size,
                                          config.cache.enable_prefix_caching, arch.max_window)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.limits.max_model_len)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.speculation = None
        if config.speculative.enabled:
            self.speculation = Speculation(*build_speculation(config.speculative, self))
            if self.proposer.keeps_own_kv:  # its KV may lag the target's: keep every block
                self.block_manager.window = None
        self.scheduler.draft_at_prefill = drafts_at_prefill(
            config.speculative.draft_at_prefill, self.proposer, self.device, self.dtype)
        self.overlap = OverlappedSteps.for_engine(self) if self.parallel is None else None
        if self.static_runner is not None:  # after speculation: a head may widen the outputs
            self.static_runner.capture_graphs()
        self._states: dict[str, RequestState] = {}
        self._stat_listeners: list = []
        self._recorder = StepRecorder(self.scheduler, self.block_manager)
        self._ids = itertools.count()
        self.faults = Faults.from_env()
        logger.info("engine ready: model %s, %s on %s, %d KV blocks of %d tokens, speculation: %s",
                    self.model_name, str(self.dtype).removeprefix("torch."), self.device,
                    self.limits.num_kv_blocks, self.limits.block_size,
                    self.proposer.name if self.proposer else "none")

    @property
    def proposer(self):
        return None if self.speculation is None else self.speculation.proposer

    @property
    def controller(self):
        return None if self.speculation is None else self.speculation.controller

    @property
    def kv_block_bytes(self) -> int:
        return bytes_per_block(self.runner.model.kv_arch, self.limits.block_size, self.dtype)

    # ------------------------------------------------------------------ intake
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str = "") -> Request:
        """Tokenizes and validates; raises ValueError with a message fit for an API client.
        `cache_salt`: the tenant partition of cross-request caches (Request.cache_salt)."""
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer(prompt)["input_ids"]
        else:
            prompt_text, token_ids = None, list(prompt)
            check_prompt_ids(token_ids, self.vocab_size)
        check_fits(token_ids, params, self.limits, self.block_manager, self.config)
        # A grammar is compiled once per constraint (the server compiles it before this, off
        # the engine's thread; here it is a cache hit and a copy).
        grammar = self.grammars.matcher(params.structured) if params.structured else None
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=token_ids, sampling_params=params, eos_token_ids=self.eos_token_ids,
            prompt_text=prompt_text, grammar=grammar, cache_salt=cache_salt)
        self.faults.note(request, self.tokenizer)
        return request

    def add(self, request: Request) -> None:
        if request.request_id in self._states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                             params.stop, params.skip_special_tokens)
        self._states[request.request_id] = RequestState(
            request, detokenizer, request.prompt_text,
            [] if params.logprobs is not None else None,
        )
        self.scheduler.add(request)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str = "") -> str:
        request = self.make_request(prompt, params, request_id, cache_salt)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request at once and frees its KV blocks. Unknown ids are ignored."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        request = state.request
        if request.num_placeholder_tokens:  # tokens still in flight are never shown
            request.truncate_output(request.num_output_tokens - request.num_placeholder_tokens)
        self.scheduler.abort(request)
        self._finished(request)
        return build_output(state, [], "", None)

    def add_stat_listener(self, listener) -> None:
        """`listener.on_step(StepStats)` after every step and `listener.on_request_finished(
        RequestStats)` per finished request, both on the engine's thread."""
        self._stat_listeners.append(listener)

    def _finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        if self.proposer is not None:
            self.proposer.request_finished(request)
        if self._stat_listeners:
            summary = request_stats(request)
            for listener in self._stat_listeners:
                listener.on_request_finished(summary)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def has_unfinished(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return self.scheduler.num_unfinished > 0 or in_flight

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        if self.overlap is not None:  # plain decode steps overlap (engine/runner/overlap.py)
            outputs = self.overlap.step()
            if outputs is not None:
                return outputs
        lookahead = self.controller.lookahead if self.controller is not None else None
        self._recorder.start()
        plan = self.scheduler.schedule(lookahead)
        if plan.is_empty:
            return []
        # Drafts, set here, stay within the lookahead a padded layout was sized for.
        runner = runner_for(plan.scheduled, self.runner, self.static_runner)
        draft_probs = {}
        if self.speculation is not None:
            draft_probs = self.speculation.propose(plan, runner.row_cost(len(plan.scheduled)))
        started = time.perf_counter()
        model_input = runner.prepare(plan.scheduled)
        owners, row_starts = model_input.logits_owners, model_input.logits_row_starts
        requests = [plan.scheduled[i].request for i in owners]
        failed: dict[str, str] = {}  # request id -> why: this request alone fails (failures.py)
        bitmask = build_bitmask(requests, row_starts, model_input.num_logits, failed,
                                self.faults.grammar_check if self.faults.armed else None)
        self.faults.raise_if("step_error", requests)
        self.faults.raise_if("oom", requests)
        # rows whose token the grammar alone decides may skip the LM head
        capture = self.speculation is not None and self.speculation.wants_features(plan.scheduled)
        hidden, logits = runner.run(model_input,
                                    known_next_tokens(requests, row_starts, bitmask),
                                    capture_features=capture)
        emitted_by_owner = verify_step(requests, row_starts, logits, draft_probs,
                                       self.generator, bitmask, self.faults, failed)
        emitted = [[] for _ in plan.scheduled]
        for owner, tokens in zip(owners, emitted_by_owner):
            emitted[owner] = tokens
        if self.speculation is not None:
            self.speculation.observe(plan.scheduled, model_input.token_row_starts, hidden,
                                     emitted, model_input.num_rows,
                                     time.perf_counter() - started)
        for request in requests:
            if request.request_id in failed:
                self._fail(request, failed[request.request_id])
        num_before = [r.num_output_tokens for r in requests]
        self.scheduler.update_from_output(plan, emitted)
        now = time.monotonic()
        latencies = [now - r.last_token_time for r in requests if r.last_token_time is not None]
        new_prompt_tokens = sum(r.num_prompt_tokens for r in requests
                                if r.first_token_time is None and r.num_output_tokens)
        outputs = [self._emit(request, before, row_start, logits, now,
                              request.output_token_ids[before:])
                   for request, before, row_start
                   in zip(requests, num_before, model_input.logits_row_starts)]
        self._report_step(plan, new_prompt_tokens, outputs, latencies)
        return outputs

    def _report_step(self, plan, num_prompt_tokens: int, outputs, latencies) -> None:
        if self._stat_listeners:
            step_stats = self._recorder.finish(
                plan, num_prompt_tokens, sum(len(o.delta_token_ids) for o in outputs), latencies)
            for listener in self._stat_listeners:
                listener.on_step(step_stats)

    def _fail(self, request: Request, message: str) -> None:
        """Ends a request that failed alone (status "error"); its KV is freed."""
        logger.error("request %s failed: %s", request.request_id, message)
        request.error = message
        if request.is_finished:  # a stop condition met in the same step
            request.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)

    def _emit(self, request: Request, num_before: int, row_start: int, logits: torch.Tensor,
              now: float, new_ids: list[int]) -> RequestOutput:
        """engine.emit's output, or, where that fails (a tokenizer error, a token the grammar
        refuses), the request ended with an error."""
        state = self._states[request.request_id]
        output = None
        if request.error is None:
            try:
                self.faults.raise_if("detokenize_error", [request])
                output = emit(state, self.scheduler, num_before, row_start, logits, now,
                              new_ids)
            except Exception as error:
                if is_resource_error(error):
                    raise
                self._fail(request, describe(error))
        if output is None:  # it failed, in this step's rows or just now
            output = build_output(state, [], "", None)
        if request.is_finished:
            self._finished(request)
        return output
