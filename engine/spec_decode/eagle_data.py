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
from engine.kv_cache import KVCache
from engine.sampling_params import SamplingParams
from engine.spec_decode import train_prompts

WINDOW = 256  # training sequence length; source files are cut into pieces of this size
DRAFT_VOCAB_SIZES = (2048, 4096, 8192, 12288, 16384)
OVERLAP_NGRAM = 13  # the contamination n-gram length of GPT-3's and Llama's reports


# ------------------------------------------------------------------------------ text
def build_texts(llm, rng: random.Random, max_new_tokens: int, disk_code_tokens: int,
                max_prompts: int | None, log) -> list[tuple[list[int], str]]:
    """(token ids, text) of every training text: target generations, then source on disk.
    `max_prompts` keeps only that many chat prompts (and a quarter as many code ones)."""
    tokenizer = llm.tokenizer
    chat = train_prompts.chat_prompts(rng)
    code = train_prompts.code_prompts()
    if max_prompts is not None:
        chat, code = chat[:max_prompts], code[:max(1, max_prompts // 4)]
    prompts, params = [], []
    for n, message in enumerate(chat):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for temperature in ((0.0,) if n % 2 else (0.7,)):  # greedy and sampled answers
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_new_tokens,
                                         temperature=temperature, seed=rng.randrange(2**31)))
    for text in code:
        ids = tokenizer(text)["input_ids"]
        for temperature in (0.0, 0.8):
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_new_tokens,
                                         temperature=temperature, seed=rng.randrange(2**31)))
    log(f"generating {len(prompts)} answers with the target ...")
    started = time.time()
    outputs = []
    for start in range(0, len(prompts), 64):  # in slices, to show progress
        outputs += llm.generate(prompts[start:start + 64], params[start:start + 64])
        done = len(outputs)
        generated = sum(len(o.token_ids) for o in outputs)
        log(f"  {done}/{len(prompts)} answers, {generated} tokens, "
            f"{generated / (time.time() - started):.0f} tok/s")
    texts = [(list(o.prompt_token_ids) + list(o.token_ids), o.text) for o in outputs]
    texts += disk_code(tokenizer, disk_code_tokens, rng)
    return texts


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
    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
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
def teacher_force(target, token_lists: list[list[int]], device, log) -> list[dict]:
    """Per text: tokens, the target's features f_t (float16) and its greedy next tokens."""
    block_size = 16
    data, started, total = [], time.time(), 0
    for n, tokens in enumerate(token_lists):
        tokens = tokens[:target.arch.max_position_embeddings]
        length = len(tokens)
        num_blocks = -(-length // block_size)
        cache = KVCache(target.arch, num_blocks, block_size, target.norm.weight.dtype, device)
        meta = build_attention_metadata([length], [length], [list(range(num_blocks))],
                                        block_size, device)
        positions = torch.arange(length, device=device)
        hidden = target.hidden_states(torch.tensor(tokens, device=device), positions, cache, meta)
        features = target.norm(hidden)
        greedy = target.lm_head(features).argmax(dim=-1)
        data.append({"tokens": torch.tensor(tokens), "features": features.half().cpu(),
                     "greedy": greedy.cpu()})
        total += length
        if (n + 1) % 100 == 0 or n + 1 == len(token_lists):
            log(f"  features: {n + 1}/{len(token_lists)} texts, {total} tokens, "
                f"{total / (time.time() - started):.0f} tok/s")
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
