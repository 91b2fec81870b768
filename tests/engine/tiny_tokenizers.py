"""Small real tokenizers trained in memory (no download) and helpers for detokenizer tests.

The byte-level BPE tokenizer has a tiny vocabulary, so emoji, CJK and accented characters end up
split across several tokens, the case streaming detokenization must get right.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"

TEXTS = [
    "The weather is lovely today, isn't it?",
    "Café crème brûlée, naïve façade — déjà vu.",
    "Emoji time: 😀🎉👍🏽 and the flag 🇫🇷 plus 🧑‍💻 at work.",
    "中文测试：你好，世界！今天天气很好。日本語のテキストも。",
    "Mixed: hello 世界 😀 café\n\tindented  double  spaces\n\nend ∑∫√ ü",
]

CORPUS = [
    "The weather is lovely today and the weather was lovely yesterday.",
    "hello world, hello there, the world is big and the weather is lovely.",
    "Café crème brûlée à la française, déjà vu, naïve.",
    "你好世界，今天天气很好。中文测试文本。",
    "Emoji: 😀 🎉 👍 🇫🇷 🧑‍💻",
] * 20


def train_tokenizer(normalized: bool) -> PreTrainedTokenizerFast:
    """A BPE tokenizer: byte-level (GPT-2 / SmolLM2 style) or Metaspace (SentencePiece style)."""
    if normalized:
        # Metaspace decoding strips the leading "▁" of a sequence: the case that needs context.
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, "<unk>"])
    else:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        unk_token="<unk>" if normalized else None,
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1
) -> list[str]:
    """Appends `ids` `chunk` at a time, then flushes; returns every delta (flush's last)."""
    deltas = [detok.append(list(ids[i : i + chunk])) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def token_spans(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character span of each token in the decoded text (ASCII text: tokens decode alone)."""
    spans, pos = [], 0
    for token_id in ids:
        piece = tokenizer.decode([token_id])
        assert "\ufffd" not in piece, "helper only for text whose tokens are whole characters"
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return spans


def token_of(spans: list[tuple[int, int]], char_index: int) -> int:
    return next(i for i, (start, end) in enumerate(spans) if start <= char_index < end)
