"""IncrementalDetokenizer on real tokenizers built in memory: round trips, multi-byte characters
split across tokens, leading spaces, the decode window. Stop strings: test_detokenizer_stops.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer
from tests.engine.tiny_tokenizers import EOS, TEXTS, encode, stream

# --- round trip -----------------------------------------------------------------------------


def test_test_text_splits_multibyte_characters_across_tokens(tok: PreTrainedTokenizerFast) -> None:
    # Proves the round-trip tests below exercise split characters: some token holds only part of
    # a character's bytes, so it decodes alone to U+FFFD.
    for text in TEXTS[1:4]:
        ids = encode(tok, text)
        assert any("\ufffd" in tok.decode([i]) for i in ids), text


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_equals_full_decode(
    tok: PreTrainedTokenizerFast, text: str, chunk: int
) -> None:
    prompt = encode(tok, "Prompt: say something 😀 ")
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert detok.stop_reason is None
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_released_as_soon_as_characters_are_complete(
    tok: PreTrainedTokenizerFast, text: str
) -> None:
    ids = encode(tok, text)
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
    ids = encode(tok, "hello 世界") + [eos] + encode(tok, " 😀 bye") + [eos]
    detok = IncrementalDetokenizer(tok, [eos], skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)
    assert (EOS in detok.text) is not skip


def test_incomplete_character_at_finish_is_flushed_as_replacement(
    tok: PreTrainedTokenizerFast,
) -> None:
    ids = encode(tok, "ok 🦄")  # not in the corpus: stays split into bytes
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    assert "\ufffd" not in "".join(detok.append([i]) for i in ids[:cut])
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids[:cut])


def test_prompt_context_keeps_leading_space(sp_tok: PreTrainedTokenizerFast) -> None:
    # A SentencePiece-style decoder drops the "▁" of a sequence's first token; with the prompt as
    # context the first generated word keeps its space, as in the decoded prompt + output.
    prompt, generated = encode(sp_tok, "hello there"), encode(sp_tok, " the world is big")
    assert not sp_tok.decode(generated).startswith(" ")
    full = sp_tok.decode(prompt + generated)
    detok = IncrementalDetokenizer(sp_tok, prompt)
    assert "".join(stream(detok, generated)) == full[len(sp_tok.decode(prompt)) :]
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
    ids = encode(tok, " ".join(TEXTS))
    prompt = encode(tok, "a long prompt " * 20)
    detok = IncrementalDetokenizer(counting, prompt)  # type: ignore[arg-type]
    assert "".join(stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 100
    # Context plus the few tokens of one split character, never the whole output.
    assert counting.longest <= 8


@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_with_default_model_tokenizer(chunk: int, default_model_folder) -> None:
    real = AutoTokenizer.from_pretrained(default_model_folder)
    prompt = encode(real, "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        ids = encode(real, text) + [real.eos_token_id]
        detok = IncrementalDetokenizer(real, prompt)
        deltas = stream(detok, ids, chunk)
        assert "".join(deltas) == real.decode(ids, skip_special_tokens=True) == text
        assert all("\ufffd" not in delta for delta in deltas)


class _DecodeOnly:
    """A tokenizer with no Rust backend exposed: the detokenizer must fall back to `decode`."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self._tok, self.calls = tok, 0

    def decode(self, *args, **kwargs) -> str:
        self.calls += 1
        return self._tok.decode(*args, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decoder_and_plain_decode_give_the_same_deltas(
    tok: PreTrainedTokenizerFast, skip: bool
) -> None:
    eos = tok.eos_token_id
    ids = [i for text in TEXTS for i in encode(tok, text) + [eos]]
    plain = _DecodeOnly(tok)
    fast_deltas = stream(IncrementalDetokenizer(tok, [eos], skip_special_tokens=skip), ids)
    plain_deltas = stream(IncrementalDetokenizer(plain, [eos], skip_special_tokens=skip), ids)
    assert plain.calls > len(ids)  # the fallback really decoded
    assert fast_deltas == plain_deltas
    assert "".join(fast_deltas) == tok.decode(ids, skip_special_tokens=skip)
