"""Builds the proposer and the controller named by the speculative config."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.attention.metadata import build_attention_metadata
from engine.config import SpeculativeConfig
from engine.core.kv_cache import KVCache
from engine.metrics.spec_stats import PRIOR_ACCEPTANCE
from engine.models.loader import cache_dir, load_model
from engine.spec_decode.auto import AutoProposer
from engine.spec_decode.controller import SpeculationController
from engine.spec_decode.cost_probe import measure_step_cost
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.draft_heads import load_draft_head
from engine.spec_decode.layer_skip import calibration_cache_file, choose_layers
from engine.spec_decode.model_drafter import ModelDrafter
from engine.spec_decode.ngram import NgramLookup, NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.step_cost import DraftCost, LinearCostModel, ModelDraftCost
from engine.spec_decode.suffix import build_suffix_proposer

logger = logging.getLogger(__name__)

NGRAM_SECONDS_PER_TOKEN = 2e-5  # a prior; measured online
SHIPPED_HEADS = Path(__file__).parent / "heads"  # trained draft heads, one folder per model name


def build_speculation(spec: SpeculativeConfig, engine) -> tuple[Proposer, SpeculationController]:
    """`engine` is the LLMEngine under construction (model, KV cache, limits, tokenizer)."""
    step_cost = measure_step_cost(engine.runner.model, engine.runner.kv_cache,
                                  engine.limits.block_size, engine.device)
    max_k = spec.num_speculative_tokens
    prior = PRIOR_ACCEPTANCE
    model = engine.runner.model
    method = spec.speculative_method
    if method == "ngram":
        proposer = NgramProposer(spec.ngram_max, spec.ngram_min)
        draft_cost = DraftCost(per_step=False, seconds_per_unit=NGRAM_SECONDS_PER_TOKEN)
    elif method == "suffix":
        proposer = build_suffix_proposer(spec)
        draft_cost = DraftCost(per_step=False, seconds_per_unit=NGRAM_SECONDS_PER_TOKEN)
    elif method == "auto":
        proposer, draft_cost = build_auto(spec, engine, step_cost)
    elif method == "draft":
        draft = load_draft_model(spec.draft_model, engine)
        kv_cache = KVCache(draft.arch, engine.limits.num_kv_blocks, engine.limits.block_size,
                           engine.dtype, engine.device)
        proposer = ModelDrafter("draft", draft, kv_cache, engine.limits.block_size,
                                engine.device, catch_up=True, shared_generator=engine.generator)
        draft_step = measure_step_cost(draft, kv_cache, engine.limits.block_size, engine.device)
        draft_cost = ModelDraftCost(draft_step(1) / step_cost(1), step_cost)
    elif method == "eagle":
        proposer, draft_cost = build_eagle(spec, engine, step_cost)
        prior = proposer.head_prior
    else:  # layer-skip
        layer_ids = list(spec.draft_layer_ids) if spec.draft_layer_ids else None
        bad = [i for i in layer_ids or [] if not 0 <= i < model.arch.num_layers]
        if bad:
            raise ValueError(f"--draft-layer-ids: layer {bad[0]} does not exist (the model has "
                             f"{model.arch.num_layers})")
        if layer_ids is None:
            choice = choose_layers(
                model, engine.tokenizer, max_k, step_cost, spec.draft_layers,
                calibration_cache_file(cache_dir(), engine.model_folder, max_k, spec.draft_layers))
            layer_ids, prior = choice.layer_ids, choice.agreement
        proposer = ModelDrafter("layer-skip", model, engine.runner.kv_cache,
                                engine.limits.block_size, engine.device, layer_ids=layer_ids,
                                catch_up=False, shared_generator=engine.generator)
        draft_cost = ModelDraftCost(len(layer_ids) / model.arch.num_layers, step_cost)
    controller = SpeculationController(max_k, spec.adaptive, step_cost, draft_cost, prior)
    return proposer, controller


def build_auto(spec: SpeculativeConfig, engine,
               step_cost: LinearCostModel) -> tuple[AutoProposer, DraftCost | ModelDraftCost]:
    """Suffix and n-gram lookups, and the EAGLE head where one ships for the model (or
    --draft-head names one); without a head, `auto` chooses between the lookups alone."""
    lookup_cost = DraftCost(per_step=False, seconds_per_unit=NGRAM_SECONDS_PER_TOKEN)
    suffix, ngram = build_suffix_proposer(spec), NgramLookup(spec.ngram_max, spec.ngram_min)
    if not spec.draft_head and shipped_head(engine.model_name) is None:
        return AutoProposer(suffix, ngram, step_cost), lookup_cost
    head, head_cost = build_eagle(spec, engine, step_cost, with_ngram=False)
    return AutoProposer(suffix, ngram, step_cost, head, head_cost), head_cost


def build_eagle(spec: SpeculativeConfig, engine, step_cost: LinearCostModel,
                with_ngram: bool = True) -> tuple[EagleProposer, ModelDraftCost]:
    model = engine.runner.model
    head = load_draft_head(head_folder(spec.draft_head, engine.model_name), model,
                           engine.device, engine.dtype)
    kv_cache = KVCache(head.arch, engine.runner.kv_cache.num_blocks, engine.limits.block_size,
                       engine.dtype, engine.device)
    ngram = (max(spec.ngram_max, spec.eagle_ngram_min), spec.eagle_ngram_min) \
        if spec.eagle_ngram_min and with_ngram else None
    prior = (head.config.training or {}).get("held_out_acceptance", PRIOR_ACCEPTANCE)
    model.feature_layers = head.feature_layers  # an EAGLE-3 head reads these layers too
    proposer = EagleProposer(head, model, kv_cache, engine.limits.block_size, engine.device,
                             shared_generator=engine.generator, ngram=ngram, head_prior=prior,
                             retire=spec.adaptive)
    draft_cost = ModelDraftCost(measure_head_step(head, model, kv_cache, engine.limits.block_size,
                                                  engine.device) / step_cost(1), step_cost)
    return proposer, draft_cost


def shipped_head(model_name: str) -> Path | None:
    """The head shipped for this model: by its name, or the name before a file suffix (the
    GGUF's converted folder is named `<model>.<quantization>-<hash>`)."""
    for name in (model_name, model_name.split(".")[0]):
        if (SHIPPED_HEADS / name).is_dir():
            return SHIPPED_HEADS / name
    return None


def head_folder(draft_head: str | None, model_name: str) -> Path:
    """--draft-head, else the head shipped for this model; ValueError where there is none."""
    if draft_head:
        return Path(draft_head)
    shipped = shipped_head(model_name)
    if shipped is None:
        raise ValueError(f"no draft head ships for {model_name}: train one with `specserve "
                         f"train-draft --model PATH --output DIR` and pass --draft-head DIR")
    return shipped


def measure_head_step(head, target, kv_cache, block_size: int, device) -> float:
    """Seconds of one draft step of one sequence: the head's layer and its LM head rows."""
    meta = build_attention_metadata([1], [1], [[0]], block_size, device)
    features = torch.zeros(1, head.norm.weight.shape[0], dtype=target.norm.weight.dtype,
                           device=device)
    ids = torch.zeros(1, dtype=torch.long, device=device)
    timings = []
    for _ in range(4):
        start = time.perf_counter()
        head.draft_logits(head(features, head.embed(ids, target), ids, kv_cache, meta)
                          ).argmax().item()
        timings.append(time.perf_counter() - start)
    return min(timings[1:])


def load_draft_model(path: str, engine):
    """Loads the draft and refuses one whose vocabulary differs from the target's."""
    loaded = load_model(path, engine.device, engine.dtype)
    target_vocab, draft_vocab = engine.tokenizer.get_vocab(), loaded.tokenizer.get_vocab()
    if (loaded.model.arch.vocab_size != engine.vocab_size or target_vocab != draft_vocab):
        raise ValueError(
            f"the draft model {path} does not share the target's vocabulary (draft: "
            f"{loaded.model.arch.vocab_size} logits, {len(draft_vocab)} tokens; target: "
            f"{engine.vocab_size} logits, {len(target_vocab)} tokens)")
    return loaded.model
