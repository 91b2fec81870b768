"""IncrementalDetokenizer's stop strings: inside a token, across tokens, mid-token, multi-byte,
several at once, and the text held back while a stop string may still be starting."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer
from tests.engine.tiny_tokenizers import (
    TEXTS,
    encode,
    stream,
    token_of,
    token_spans,
)

WEATHER = "The weather is lovely today and the world is big."


def _check_stop(
    tokenizer: PreTrainedTokenizerFast,
    text: str,
    stop: tuple[str, ...],
    expected_text: str,
    expected_stop: str,
    chunk: int = 1,
) -> list[str]:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Q: "), stop=stop)
    deltas = [detok.append(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == expected_text
    assert detok.text == expected_text
    assert detok.stop_reason == expected_stop
    for delta in deltas:
        assert all(s not in delta for s in stop)
    # Nothing after the stop, whatever comes.
    assert detok.append(encode(tokenizer, " more text")) == ""
    assert detok.flush() == ""
    assert detok.text == expected_text
    return deltas


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_inside_one_token(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    spans = token_spans(tok, encode(tok, WEATHER))
    start = WEATHER.index("eathe")
    token = token_of(spans, start)
    assert spans[token][0] < start and start + len("eathe") < spans[token][1]
    _check_stop(tok, WEATHER, ("eathe",), "The w", "eathe", chunk)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_spanning_tokens(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    stop = " is lovely today"
    spans = token_spans(tok, encode(tok, WEATHER))
    start = WEATHER.index(stop)
    first, last = token_of(spans, start), token_of(spans, start + len(stop) - 1)
    assert last - first >= 2 and spans[first][0] == start
    _check_stop(tok, WEATHER, (stop,), "The weather", stop, chunk)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_starting_mid_token(tok: PreTrainedTokenizerFast, chunk: int) -> None:
    stop = "her is lov"
    spans = token_spans(tok, encode(tok, WEATHER))
    start = WEATHER.index(stop)
    first, last = token_of(spans, start), token_of(spans, start + len(stop) - 1)
    assert spans[first][0] < start and last > first
    _check_stop(tok, WEATHER, (stop,), "The weat", stop, chunk)


@pytest.mark.parametrize("chunk", [1, 100])
def test_multibyte_stop_string_split_across_byte_tokens(
    tok: PreTrainedTokenizerFast, chunk: int
) -> None:
    text = "Emoji time: 😀🎉 done"
    assert any("\ufffd" in tok.decode([i]) for i in encode(tok, "😀🎉"))
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
    ids = encode(tok, text)
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
    streamed = "".join(detok.append([i]) for i in encode(tok, "it is lovely yesterday"))
    # Held only while "lovely " could still become "lovely today".
    assert streamed == "it is lovely yesterday"
    assert detok.flush() == ""


def test_held_back_is_at_most_the_stop_prefix(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("abcdef", "world"))
    out = [detok.append([i]) for i in encode(tok, "hello wor")]
    # Only the tail that starts a stop string ("wor") waits; "hello " is out at once.
    assert "".join(out) == "hello "
    assert detok.flush() == "wor"


def test_round_trip_with_unmatched_stop_strings(tok: PreTrainedTokenizerFast) -> None:
    for text in TEXTS:
        ids = encode(tok, text)
        detok = IncrementalDetokenizer(tok, [], stop=("never appears", "世界X", "😀😀"))
        assert "".join(stream(detok, ids, 2)) == text
        assert detok.stop_reason is None


def test_invalid_use(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=("",))
    detok = IncrementalDetokenizer(tok, [])
    assert detok.append([]) == ""
    detok.flush()
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.append(encode(tok, "x"))
