"""`specserve train-draft`: trains an EAGLE head (eagle_head.py) for a target model, here.

1. Text (eagle_data.py). The target's own answers to the prompts in train_prompts.py (greedy and sampled), which
   is what the head must predict when serving, plus Python source found on disk (the standard
   library's, PSF licence) for code. No data set is downloaded; HumanEval and MT-Bench, the
   measurement sets, are checked for n-gram overlap and the result is reported.
2. Features. Each text is teacher-forced through the target once; its normalized final hidden
   states f_t (what its LM head reads) are kept, with the target's greedy next token.
   With EAGLE-3 features (the default) the outputs of a low, a middle and a high layer are kept
   too (each RMS-normalized): the head reads their projection instead of the last layer's.
3. Draft vocabulary: the N tokens the target predicts most often, N the smallest size covering
   `vocab_coverage` of its greedy predictions on the training text.
4. Training. The head reads (f_t, embed(x_{t+1})) and predicts f_{t+1}: loss = cross-entropy
   between the target's and the head's draft-vocabulary distributions + `regression_weight` x
   smooth-L1 on the feature (EAGLE's loss weighs them 0.1 : 1; EAGLE-3 drops the feature term).
   Training-time test: `unroll` passes, each after the first feeding the head its own
   predictions, as drafting does after the first token. Held-out acceptance (the head's argmax
   equals the target's greedy token), on texts of prompts never trained on, is printed as it
   trains.
5. The head is our own architecture (`architecture="eagle"`) or EAGLE-3's, written in the
   published layout that other engines load (`"eagle3"`): trained_heads.py.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from training.eagle_data import (
    OVERLAP_NGRAM,
    WINDOW,
    build_texts,
    cached_texts,
    choose_draft_vocab,
    measurement_overlap,
    teacher_force,
)
from training.trained_heads import feature_layers_for, new_head, write_head

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"



@dataclass
class TrainOptions:
    max_minutes: float = 35.0  # training time, after the data is built
    max_new_tokens: int = 256
    templates_per_topic: int = 6  # chat prompts per topic (train_prompts.py)
    eagle3: bool = True  # read a low, a middle and a high layer (EAGLE-3), not only the last
    architecture: str = "eagle"  # "eagle": our own head; "eagle3": EAGLE-3's, published layout
    regression_weight: float = 0.1
    disk_code_tokens: int = 30_000  # Python source from the standard library
    vocab_coverage: float = 0.985
    batch_windows: int = 8
    learning_rate: float = 1e-3
    unroll: int = 3  # passes per window: 1 = teacher-forced only
    seed: int = 0
    held_out: float = 0.05
    max_prompts: int | None = None  # for smoke tests
    # Where the generated texts and a training checkpoint (every 50 steps) are kept: a run
    # given the same folder again reuses the texts and goes on from the checkpoint.
    work_dir: Path | None = None


def train_draft(model: str | None, output: Path, options: TrainOptions, device: str | None = None,
                log=print) -> dict:
    """Builds the data, trains, writes `output`; returns the training summary."""
    head, summary, target, target_name = train_head(model, options, device, log)
    write_head(head, Path(output), target, target_name, summary)
    log(f"wrote {output} ({summary['minutes']} min in all)")
    return summary


def train_head(model: str | None, options: TrainOptions, device: str | None = None, log=print):
    """Builds the data and trains: (head, summary, target, target name), nothing written."""
    from engine import LLM

    torch.manual_seed(options.seed)
    rng = random.Random(options.seed)
    started = time.time()
    llm = LLM(model, speculative_method="none", device=device, max_num_seqs=32)
    engine = llm.engine
    target, tokenizer = engine.runner.model, engine.tokenizer
    feature_layers = feature_layers_for(options.architecture, target.arch, options.eagle3)
    texts = cached_texts(options.work_dir, log, lambda: build_texts(
        llm, rng, options.max_new_tokens, options.disk_code_tokens, options.max_prompts, log,
        options.templates_per_topic))
    overlap = measurement_overlap(tokenizer, [t for _, t, _ in texts])
    log(f"overlap with HumanEval/MT-Bench: {overlap['shared_ngrams']} shared "
        f"{OVERLAP_NGRAM}-grams of {overlap['benchmark_ngrams']}")
    # Held out: every text of a few prompts, so that no answer to a held-out prompt is trained on.
    groups = sorted({group for _, _, group in texts})
    random.Random(options.seed).shuffle(groups)
    held_groups = set(groups[:max(1, int(len(groups) * options.held_out))])
    texts.sort(key=lambda t: t[2] not in held_groups)  # held-out texts first
    num_held = sum(t[2] in held_groups for t in texts)
    data = teacher_force(target, [ids for ids, _, _ in texts], engine.device, log,
                         tuple(feature_layers), raw_layers=options.architecture == "eagle3")
    vocab, coverage = choose_draft_vocab(data[num_held:], target.arch.vocab_size,
                                         options.vocab_coverage)
    log(f"draft vocabulary: {len(vocab)} tokens cover {100 * coverage[len(vocab)]:.1f}% of the "
        f"target's greedy predictions ({', '.join(f'{n}: {100 * c:.1f}%' for n, c in coverage.items())})")
    head = new_head(options.architecture, target, feature_layers, vocab, engine.device,
                    options.seed)
    history = train(head, target, data[num_held:], data[:num_held], options, log)
    summary = {
        "texts": len(texts), "tokens": sum(len(d["tokens"]) for d in data),
        "held_out_texts": num_held, "draft_vocab_coverage": coverage,
        "overlap": overlap, "minutes": round((time.time() - started) / 60, 1),
        "options": {k: v for k, v in asdict(options).items() if k != "work_dir"}, **history,
    }
    return head, summary, target, engine.model_name


# -------------------------------------------------------------------------- training
def _windows(data: list[dict]) -> list[tuple[int, int, int]]:
    """(text, start, length) windows of at most WINDOW positions that have a next token."""
    out = []
    for index, d in enumerate(data):
        usable = len(d["tokens"]) - 1
        for start in range(0, usable, WINDOW):
            length = min(WINDOW, usable - start)
            if length >= 8:
                out.append((index, start, length))
    return out


def _batch(data, windows, target, draft_index, device, use_layers: bool):
    """Inputs and targets of a batch, padded to the longest window (padding masked out). Inputs:
    the feature layers' outputs with `use_layers`, else the final features."""
    longest = max(length for _, _, length in windows)
    hidden = target.arch.hidden_size
    width = data[windows[0][0]]["layers"].shape[-1] if use_layers else hidden
    inputs = torch.zeros(len(windows), longest, width)
    wanted = torch.zeros(len(windows), longest, hidden)
    next_ids = torch.zeros(len(windows), longest, dtype=torch.long)
    greedy = torch.full((len(windows), longest), -1, dtype=torch.long)
    mask = torch.zeros(len(windows), longest, dtype=torch.bool)
    for row, (index, start, length) in enumerate(windows):
        d = data[index]
        source = d["layers"] if use_layers else d["features"]
        inputs[row, :length] = source[start:start + length].float()
        wanted[row, :length] = d["features"][start + 1:start + length + 1].float()
        next_ids[row, :length] = d["tokens"][start + 1:start + length + 1]
        greedy[row, :length] = draft_index[d["greedy"][start + 1:start + length + 1]]
        mask[row, :length] = True
    with torch.inference_mode():
        embeds = target.embed(next_ids.to(device).flatten()).float().view(len(windows), longest,
                                                                          hidden)
    # inference tensors cannot be saved for backward: clone into normal ones
    return (inputs.to(device), embeds.clone(), wanted.to(device), greedy.to(device),
            mask.to(device))


def _losses(head, inputs, embeds, wanted, mask, unroll: int, regression_weight: float):
    """Per pass: (loss, predictions). Each pass after the first reads the one before's
    predictions as its features (training-time test)."""
    passes = []
    first = head.train_first(inputs)
    features = first
    for _ in range(unroll):
        predicted = head.train_forward(features, embeds)  # what the next pass reads
        normed = head.train_normed(predicted)  # what the LM head reads
        regression = F.smooth_l1_loss(normed, wanted, reduction="none").mean(-1)
        with torch.no_grad():
            target_logp = F.log_softmax(F.linear(wanted, head.lm_head.weight).float(), dim=-1)
        head_logp = F.log_softmax(F.linear(normed, head.lm_head.weight).float(), dim=-1)
        classification = -(target_logp.exp() * head_logp).sum(-1)
        per_position = classification + regression_weight * regression
        loss = (per_position * mask).sum() / mask.sum()
        passes.append((loss, head_logp.detach()))
        # The next pass: position t reads the head's prediction of f_t (made at t - 1).
        features = torch.cat([first[:, :1], predicted[:, :-1]], dim=1)
    return passes


def train(head, target, train_data, held_data, options: TrainOptions, log) -> dict:
    """Trains `head` (an EagleHead or an Eagle3Head, trained_heads.py) in place."""
    device = head.norm.weight.device
    use_layers = bool(head.feature_layers)
    draft_index = torch.full((target.arch.vocab_size,), -1, dtype=torch.long)
    draft_index[head.token_ids.cpu()] = torch.arange(head.draft_vocab_size)
    windows = _windows(train_data)
    held_windows = _windows(held_data)
    params = list(head.trained_parameters().values())
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=0.0,
                                  betas=(0.9, 0.95))
    rng = random.Random(options.seed)
    tokens_per_epoch = sum(w[2] for w in windows)
    log(f"training on {len(windows)} windows ({tokens_per_epoch} positions), "
        f"{len(held_windows)} held out, for {options.max_minutes:g} min")
    step, seen, evaluations, order, estimated_steps, seconds = 0, 0, [], [], None, 0.0
    checkpoint = options.work_dir / CHECKPOINT if options.work_dir else None
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        with torch.no_grad():
            for name, param in head.trained_parameters().items():
                param.copy_(saved["head"][name])
        optimizer.load_state_dict(saved["optimizer"])
        rng.setstate(saved["rng"])
        step, seen, evaluations, order, estimated_steps, seconds = (
            saved[k] for k in ("step", "seen", "evaluations", "order", "estimated_steps",
                               "seconds"))
        log(f"resuming from {checkpoint}: step {step}, {seconds / 60:.1f} min trained")
    started = time.time() - seconds  # as if the earlier runs' training had just happened
    deadline = started + 60 * options.max_minutes
    while time.time() < deadline:
        if not order:
            order = windows[:]
            rng.shuffle(order)
        batch_windows, order = order[:options.batch_windows], order[options.batch_windows:]
        inputs, embeds, wanted, greedy, mask = _batch(train_data, batch_windows, target,
                                                      draft_index, device, use_layers)
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 0.2  # EAGLE's feature noise
        passes = _losses(head, inputs, embeds, wanted, mask, options.unroll,
                         options.regression_weight)
        loss = sum(p[0] for p in passes) / len(passes)
        # Cosine decay over the steps the time budget allows (estimated after 20 steps).
        if step == 20:
            per_step = (time.time() - started) / 20
            estimated_steps = max(40, int(60 * options.max_minutes / per_step))
        progress = step / estimated_steps if estimated_steps else 0.0
        lr = options.learning_rate * min(1.0, (step + 1) / 20) * \
            0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = max(lr, options.learning_rate * 0.02)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        seen += int(mask.sum())
        if step % 50 == 0 or time.time() >= deadline:
            acceptance = evaluate(head, target, held_data, held_windows, draft_index, options)
            evaluations.append({"step": step, "positions": seen, "loss": round(loss.item(), 4),
                                **acceptance})
            log(f"  step {step}: loss {loss.item():.3f}, {seen / (time.time() - started):.0f} "
                f"positions/s, held-out acceptance by draft "
                f"{acceptance['held_out_acceptance_by_draft']}")
            sys.stdout.flush()
            if checkpoint is not None:
                torch.save({"head": {n: p.detach().cpu() for n, p in
                                     head.trained_parameters().items()},
                            "optimizer": optimizer.state_dict(), "rng": rng.getstate(),
                            "step": step, "seen": seen, "evaluations": evaluations,
                            "order": order, "estimated_steps": estimated_steps,
                            "seconds": time.time() - started}, checkpoint)
    last = evaluations[-1] if evaluations else evaluate(head, target, held_data, held_windows,
                                                        draft_index, options)
    return {"steps": step, "positions_seen": seen, "epochs": round(seen / max(tokens_per_epoch, 1), 2),
            "held_out_acceptance": last["held_out_acceptance"],
            "held_out_acceptance_unrolled": last["held_out_acceptance_unrolled"],
            "evaluations": evaluations}


@torch.no_grad()
def evaluate(head, target, data, windows, draft_index, options) -> dict:
    """Share of held-out positions where the head's argmax is the target's greedy token: with
    the target's features (the first draft) and with its own (each draft after it)."""
    passes = max(2, options.unroll)
    hits = [0] * passes
    total = 0
    for start in range(0, len(windows), 16):
        inputs, embeds, wanted, greedy, mask = _batch(data, windows[start:start + 16], target,
                                                      draft_index, head.norm.weight.device,
                                                      bool(head.feature_layers))
        results = _losses(head, inputs, embeds, wanted, mask, passes, options.regression_weight)
        for n, (_, logp) in enumerate(results):
            hits[n] += int(((logp.argmax(-1) == greedy) & mask).sum())
        total += int(mask.sum())
    by_draft = [round(h / max(total, 1), 4) for h in hits]
    return {"held_out_acceptance": by_draft[0], "held_out_acceptance_unrolled": by_draft[1],
            "held_out_acceptance_by_draft": by_draft}
