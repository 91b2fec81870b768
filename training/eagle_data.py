"""The training data of `specserve train-draft` (eagle_train.py): texts and the target's features.

Texts are the target's own answers to the prompts in train_prompts.py plus Python source from
the standard library on disk; nothing is downloaded. Each text is teacher-forced through the
target once, keeping its normalized final hidden states and greedy next tokens. HumanEval and
MT-Bench, the measurement sets, are only read to report their n-gram overlap with the texts.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from pathlib import Path

import torch

from engine.attention.metadata import build_attention_metadata
from engine.core.kv_cache import KVCache
from engine.sampling_params import SamplingParams
from training import train_prompts
from engine.spec_decode.eagle_head import normalize_layers

WINDOW = 256  # training sequence length; source files are cut into pieces of this size
DRAFT_VOCAB_SIZES = (2048, 4096, 8192, 12288, 16384)
OVERLAP_NGRAM = 13  # the contamination n-gram length of GPT-3's and Llama's reports


# ------------------------------------------------------------------------------ text
def build_texts(llm, rng: random.Random, max_new_tokens: int, disk_code_tokens: int,
                max_prompts: int | None, log, templates_per_topic: int = 3
                ) -> list[tuple[list[int], str, int]]:
    """(token ids, text, group) of every training text: the target's answers (greedy and
    sampled; the greedy chat answers continued by a second user turn and the target's second
    answer), then source on disk. Texts from one prompt share a group, so that held-out texts
    can be kept apart by prompt. `max_prompts` keeps only that many chat prompts (and a quarter
    as many code ones)."""
    tokenizer = llm.tokenizer
    chat = train_prompts.chat_prompts(rng, templates_per_topic)
    code = train_prompts.code_prompts()
    if max_prompts is not None:
        chat, code = chat[:max_prompts], code[:max(1, max_prompts // 4)]
    jobs = []  # (prompt ids, temperature, group)
    for n, message in enumerate(chat):
        ids = _chat_ids(tokenizer, [{"role": "user", "content": message}])
        jobs += [(ids, 0.0, n), (ids, 0.7, n)]
    for n, text in enumerate(code):
        ids = tokenizer(text)["input_ids"]
        jobs += [(ids, temperature, len(chat) + n) for temperature in (0.0, 0.8, 1.0)]
    outputs = _generate(llm, jobs, max_new_tokens, rng, log)
    texts = [(list(o.prompt_token_ids) + list(o.token_ids), o.text, group)
             for o, (_, _, group) in zip(outputs, jobs)]
    # Second turns: each greedy chat answer, a follow-up question, and the target's answer to it.
    firsts = [i for i, (_, temperature, group) in enumerate(jobs)
              if temperature == 0.0 and group < len(chat)]
    follow_ups = []
    for i in firsts:
        conversation = [{"role": "user", "content": chat[jobs[i][2]]},
                        {"role": "assistant", "content": outputs[i].text},
                        {"role": "user", "content": rng.choice(train_prompts.FOLLOW_UPS)}]
        follow_ups.append((_chat_ids(tokenizer, conversation), 0.0, jobs[i][2]))
    for i, o in zip(firsts, _generate(llm, follow_ups, max_new_tokens, rng, log)):
        texts[i] = (list(o.prompt_token_ids) + list(o.token_ids), o.text, jobs[i][2])
    group = len(chat) + len(code)
    for ids, text in disk_code(tokenizer, disk_code_tokens, rng):
        texts.append((ids, text, group))
        group += 1
    return texts


def cached_texts(work_dir: Path | None, log, build) -> list[tuple[list[int], str, int]]:
    """`build()`'s texts, kept in work_dir/texts.json and read from there when it exists."""
    path = work_dir / "texts.json" if work_dir is not None else None
    if path is not None and path.is_file():
        texts = [tuple(t) for t in json.loads(path.read_text())]
        log(f"read {len(texts)} texts from {path}")
        return texts
    texts = build()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(texts))
    return texts


def _chat_ids(tokenizer, conversation: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _generate(llm, jobs, max_new_tokens: int, rng: random.Random, log) -> list:
    """The target's answers to (prompt ids, temperature, group) jobs, in order."""
    if not jobs:
        return []
    prompts = [ids for ids, _, _ in jobs]
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                             seed=rng.randrange(2**31)) for _, temperature, _ in jobs]
    log(f"generating {len(prompts)} answers with the target ...")
    started = time.time()
    outputs = []
    for start in range(0, len(prompts), 64):  # in slices, to show progress
        outputs += llm.generate(prompts[start:start + 64], params[start:start + 64])
        generated = sum(len(o.token_ids) for o in outputs)
        log(f"  {len(outputs)}/{len(prompts)} answers, {generated} tokens, "
            f"{generated / (time.time() - started):.0f} tok/s")
    return outputs


def disk_code(tokenizer, num_tokens: int, rng: random.Random) -> list[tuple[list[int], str]]:
    """Pieces of the Python standard library's own source (PSF licence), up to num_tokens."""
    if num_tokens <= 0:
        return []
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in folder.glob("*.py") if p.stat().st_size > 2000)
    rng.shuffle(files)
    pieces, total = [], 0
    for path in files:
        text = path.read_text(errors="ignore")
        ids = tokenizer(text)["input_ids"]
        for start in range(0, min(len(ids), 4 * WINDOW), WINDOW):
            piece = ids[start:start + WINDOW]
            if len(piece) >= 64:
                pieces.append((piece, tokenizer.decode(piece)))
                total += len(piece)
        if total >= num_tokens:
            break
    return pieces


def measurement_overlap(tokenizer, texts: list[str]) -> dict:
    """Shared word 13-grams between the training texts and the bundled HumanEval / MT-Bench."""
    # the bench's prompt sets, beside this package (installed or in the repository)
    data = Path(__file__).resolve().parents[1] / "specserve" / "bench" / "data"
    bench_texts = []
    for name in ("humaneval_subset.jsonl", "mt_bench_subset.jsonl"):
        path = data / name
        if path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                bench_texts += [record.get("prompt", ""), record.get("canonical_solution", ""),
                                *record.get("turns", [])]
    bench = set().union(*(_word_ngrams(t) for t in bench_texts)) if bench_texts else set()
    ours = set().union(*(_word_ngrams(t) for t in texts)) if texts else set()
    return {"shared_ngrams": len(bench & ours), "benchmark_ngrams": len(bench),
            "n": OVERLAP_NGRAM, "benchmark_files_found": bool(bench_texts)}


def _word_ngrams(text: str) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + OVERLAP_NGRAM]) for i in range(len(words) - OVERLAP_NGRAM + 1)}


# -------------------------------------------------------------------------- features
@torch.inference_mode()
def teacher_force(target, token_lists: list[list[int]], device, log,
                  feature_layers: tuple[int, ...] = (), raw_layers: bool = False) -> list[dict]:
    """Per text: tokens, the target's features f_t (float16), its greedy next tokens and, with
    `feature_layers`, those layers' outputs, each RMS-normalized (float16), or with `raw_layers`
    as they are (bfloat16: EAGLE-3's fc reads the raw residual streams, whose outliers can pass
    float16's range)."""
    block_size = 16
    data, started, total = [], time.time(), 0
    hidden_size = target.arch.hidden_size
    target.feature_layers, kept = tuple(feature_layers), target.feature_layers
    try:
        for n, tokens in enumerate(token_lists):
            tokens = tokens[:target.arch.max_position_embeddings]
            length = len(tokens)
            num_blocks = -(-length // block_size)
            cache = KVCache(target.arch, num_blocks, block_size, target.norm.weight.dtype, device)
            meta = build_attention_metadata([length], [length], [list(range(num_blocks))],
                                            block_size, device)
            positions = torch.arange(length, device=device)
            hidden = target.hidden_states(torch.tensor(tokens, device=device), positions, cache,
                                          meta)
            features = target.norm(hidden[:, :hidden_size].contiguous())
            greedy = target.lm_head(features).argmax(dim=-1)
            item = {"tokens": torch.tensor(tokens), "features": features.half().cpu(),
                    "greedy": greedy.cpu()}
            if feature_layers:
                layers = hidden[:, hidden_size:]
                item["layers"] = layers.bfloat16().cpu() if raw_layers else \
                    normalize_layers(layers, target.arch).half().cpu()
            data.append(item)
            total += length
            if (n + 1) % 100 == 0 or n + 1 == len(token_lists):
                log(f"  features: {n + 1}/{len(token_lists)} texts, {total} tokens, "
                    f"{total / (time.time() - started):.0f} tok/s")
    finally:
        target.feature_layers = kept
    return data


def choose_draft_vocab(data: list[dict], vocab_size: int, coverage_wanted: float
                       ) -> tuple[torch.Tensor, dict[int, float]]:
    """The most frequent greedy predictions; the smallest listed size reaching the coverage."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for d in data:
        counts += torch.bincount(d["greedy"], minlength=vocab_size)
    order = counts.argsort(descending=True)
    total = counts.sum().item()
    sizes = [n for n in DRAFT_VOCAB_SIZES if n < vocab_size] or [vocab_size]
    coverage = {n: counts[order[:n]].sum().item() / total for n in sizes}
    chosen = next((n for n in sizes if coverage[n] >= coverage_wanted), sizes[-1])
    return order[:chosen].sort().values, coverage
