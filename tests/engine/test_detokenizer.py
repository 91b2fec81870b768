"""Tests of IncrementalDetokenizer on real tokenizers built in memory (no download).

The byte-level BPE tokenizer is trained with a tiny vocabulary, so emoji, CJK and accented
characters end up split across several tokens, the case streaming detokenization must get right.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer

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


def _train(normalized: bool) -> PreTrainedTokenizerFast:
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


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _train(normalized=False)


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    return _train(normalized=True)


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1
) -> list[str]:
    """Appends `ids` `chunk` at a time, then flushes; returns every delta (flush's last)."""
    deltas = [detok.append(list(ids[i : i + chunk])) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def _token_spans(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character span of each token in the decoded text (ASCII text: tokens decode alone)."""
    spans, pos = [], 0
    for token_id in ids:
        piece = tokenizer.decode([token_id])
        assert "\ufffd" not in piece, "helper only for text whose tokens are whole characters"
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return spans


def _token_of(spans: list[tuple[int, int]], char_index: int) -> int:
    return next(i for i, (start, end) in enumerate(spans) if start <= char_index < end)


# --- round trip -----------------------------------------------------------------------------


def test_test_text_splits_multibyte_characters_across_tokens(tok: PreTrainedTokenizerFast) -> None:
    # Proves the round-trip tests below exercise split characters: some token holds only part of
    # a character's bytes, so it decodes alone to U+FFFD.
    for text in TEXTS[1:4]:
        ids = _ids(tok, text)
        assert any("\ufffd" in tok.decode([i]) for i in ids), text


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_equals_full_decode(
    tok: PreTrainedTokenizerFast, text: str, chunk: int
) -> None:
    prompt = _ids(tok, "Prompt: say something 😀 ")
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert detok.stop_reason is None
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_released_as_soon_as_characters_are_complete(
    tok: PreTrainedTokenizerFast, text: str
) -> None:
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, [])
    for n in range(1, len(ids) + 1):
        detok.append(ids[n - 1 : n])
        # Everything except a trailing incomplete character is out already.
        assert detok.text == tok.decode(ids[:n]).rstrip("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(
    tok: PreTrainedTokenizerFast, skip: bool
) -> None:
    eos = tok.eos_token_id
    ids = _ids(tok, "hello 世界") + [eos] + _ids(tok, " 😀 bye") + [eos]
    detok = IncrementalDetokenizer(tok, [eos], skip_special_tokens=skip)
    assert "".join(_stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)
    assert (EOS in detok.text) is not skip


def test_incomplete_character_at_finish_is_flushed_as_replacement(
    tok: PreTrainedTokenizerFast,
) -> None:
    ids = _ids(tok, "ok 🦄")  # not in the corpus: stays split into bytes
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    assert "\ufffd" not in "".join(detok.append([i]) for i in ids[:cut])
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids[:cut])


def test_prompt_context_keeps_leading_space(sp_tok: PreTrainedTokenizerFast) -> None:
    # A SentencePiece-style decoder drops the "▁" of a sequence's first token; with the prompt as
    # context the first generated word keeps its space, as in the decoded prompt + output.
    prompt, generated = _ids(sp_tok, "hello there"), _ids(sp_tok, " the world is big")
    assert not sp_tok.decode(generated).startswith(" ")
    full = sp_tok.decode(prompt + generated)
    detok = IncrementalDetokenizer(sp_tok, prompt)
    assert "".join(_stream(detok, generated)) == full[len(sp_tok.decode(prompt)) :]
    assert detok.text.startswith(" the")


def test_decode_window_stays_small(tok: PreTrainedTokenizerFast) -> None:
    class CountingTokenizer:
        """Records the longest id list decoded."""

        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: Sequence[int], **kwargs: bool) -> str:
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, **kwargs)

    counting = CountingTokenizer()
    ids = _ids(tok, " ".join(TEXTS))
    prompt = _ids(tok, "a long prompt " * 20)
    detok = IncrementalDetokenizer(counting, prompt)  # type: ignore[arg-type]
    assert "".join(_stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 100
    # Context plus the few tokens of one split character, never the whole output.
    assert counting.longest <= 8


@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_with_default_model_tokenizer(chunk: int, default_model_folder) -> None:
    real = AutoTokenizer.from_pretrained(default_model_folder)
    prompt = _ids(real, "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        ids = _ids(real, text) + [real.eos_token_id]
        detok = IncrementalDetokenizer(real, prompt)
        deltas = _stream(detok, ids, chunk)
        assert "".join(deltas) == real.decode(ids, skip_special_tokens=True) == text
        assert all("\ufffd" not in delta for delta in deltas)


# --- stop strings ---------------------------------------------------------------------------

WEATHER = "The weather is lovely today and the world is big."


def _check_stop(
    tokenizer: PreTrainedTokenizerFast,
    text: str,
    stop: tuple[str, ...],
    expected_text: str,
    expected_stop: str,
    chunk: int = 1,
) -> list[str]:
    ids = _ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, _ids(tokenizer, "Q: "), stop=stop)
    deltas = [detok.append(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == expected_text
    assert detok.text == expected_text
    assert detok.stop_reason == expected_stop
    for delta in deltas:
        assert all(s not in delta for s in stop)
    # Nothing after the stop, whatever comes.
    assert detok.append(_ids(tokenizer, " more text")) == ""
    assert detok.flush() == ""
    assert detok.text == expected_text
    return deltas


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_inside_one_token(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    spans = _token_spans(tok, _ids(tok, WEATHER))
    start = WEATHER.index("eathe")
    token = _token_of(spans, start)
    assert spans[token][0] < start and start + len("eathe") < spans[token][1]
    _check_stop(tok, WEATHER, ("eathe",), "The w", "eathe", chunk)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_spanning_tokens(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    stop = " is lovely today"
    spans = _token_spans(tok, _ids(tok, WEATHER))
    start = WEATHER.index(stop)
    first, last = _token_of(spans, start), _token_of(spans, start + len(stop) - 1)
    assert last - first >= 2 and spans[first][0] == start
    _check_stop(tok, WEATHER, (stop,), "The weather", stop, chunk)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_starting_mid_token(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    stop = "her is lov"
    spans = _token_spans(tok, _ids(tok, WEATHER))
    start = WEATHER.index(stop)
    first, last = _token_of(spans, start), _token_of(spans, start + len(stop) - 1)
    assert spans[first][0] < start and last > first
    _check_stop(tok, WEATHER, (stop,), "The weat", stop, chunk)


@pytest.mark.parametrize("chunk", [1, 100])
def test_multibyte_stop_string_split_across_byte_tokens(
    tok: PreTrainedTokenizerFast, chunk: int
) -> None:
    text = "Emoji time: 😀🎉 done"
    assert any("\ufffd" in tok.decode([i]) for i in _ids(tok, "😀🎉"))
    _check_stop(tok, text, ("😀🎉",), "Emoji time: ", "😀🎉", chunk)


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_of_two_stop_strings_wins(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    _check_stop(tok, WEATHER, ("world", "lovely"), "The weather is ", "lovely", chunk)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_overlapping_stop_strings_first_completed_wins(
    tok: PreTrainedTokenizerFast, chunk: int
) -> None:
    # "weather is lovely" starts first but "is lo" completes first: reading character by
    # character one would stop there, so the result must not depend on how many tokens come
    # per append().
    stops = ("weather is lovely", "is lo")
    _check_stop(tok, WEATHER, stops, "The weather ", "is lo", chunk)


def test_possible_stop_prefix_is_held_back_until_flush(tok: PreTrainedTokenizerFast) -> None:
    text = "The weather is lov"
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=("lovely",))
    streamed = "".join(detok.append([i]) for i in ids)
    assert streamed == "The weather is "
    assert detok.text == streamed
    assert detok.flush() == "lov"
    assert detok.text == text
    assert detok.stop_reason is None


def test_held_back_text_released_when_it_cannot_start_a_stop(
    tok: PreTrainedTokenizerFast,
) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("lovely today",))
    streamed = "".join(detok.append([i]) for i in _ids(tok, "it is lovely yesterday"))
    # Held only while "lovely " could still become "lovely today".
    assert streamed == "it is lovely yesterday"
    assert detok.flush() == ""


def test_held_back_is_at_most_the_stop_prefix(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("abcdef", "world"))
    out = [detok.append([i]) for i in _ids(tok, "hello wor")]
    # Only the tail that starts a stop string ("wor") waits; "hello " is out at once.
    assert "".join(out) == "hello "
    assert detok.flush() == "wor"


def test_round_trip_with_unmatched_stop_strings(tok: PreTrainedTokenizerFast) -> None:
    for text in TEXTS:
        ids = _ids(tok, text)
        detok = IncrementalDetokenizer(tok, [], stop=("never appears", "世界X", "😀😀"))
        assert "".join(_stream(detok, ids, 2)) == text
        assert detok.stop_reason is None


def test_invalid_use(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=("",))
    detok = IncrementalDetokenizer(tok, [])
    assert detok.append([]) == ""
    detok.flush()
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.append(_ids(tok, "x"))
