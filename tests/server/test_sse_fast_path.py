"""The steady-state chunk rendered without pydantic (server/sse_chunks.py) is byte for byte what
pydantic's `model_dump_json` gives, for chat and completions, with and without usage."""

from __future__ import annotations

import random

import pytest

from server import sse_chunks
from server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
)
from server.sse_chunks import TextChunks
from server.streaming import event

TEXTS = [
    "", "hello", " world", 'say "hi"', "back\\slash", "a/b", "tab\there", "line\nbreak",
    "cr\r", "\b\f", "\x00\x01\x1f\x7f", "\u2028\u2029", "é", "日本語", "🙂 emoji", "\ufffd",
    "</script>", "{\"json\": [1, 2]}", "'single'", "\u0085 next line", "mixed \"\\\n\t é 🙂",
]


def _random_texts(count: int) -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["日", "🙂", "\u2028", "\ufeff", "\U0010ffff"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24)))
            for _ in range(count)]


def _chat(index: int, text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-abc", created=1733333333, model='m"odel/é',
                               choices=[ChatChunkChoice(index=index, delta={"content": text})])


def _completion(index: int, text: str) -> CompletionResponse:
    return CompletionResponse(id="cmpl-abc", created=1733333333, model="model",
                              choices=[CompletionChoice(index=index, text=text)])


@pytest.mark.parametrize("build", [_chat, _completion])
@pytest.mark.parametrize("with_usage", [False, True])
def test_fast_path_bytes_equal_pydantic(build, with_usage):
    chunks = TextChunks(build, with_usage)
    for index in (0, 3):
        for text in TEXTS + _random_texts(500):
            expected = event(build(index, text), with_usage)
            assert chunks.event(index, text).encode() == expected.encode(), repr(text)


def test_negative_control_a_wrongly_escaped_text_differs(monkeypatch):
    """Escaping as ASCII (or not at all) is caught: the test above is not vacuous."""
    import json
    chunks = TextChunks(_chat, True)
    expected = event(_chat(0, "é \"q\""), True)
    assert chunks.event(0, "é \"q\"") == expected
    monkeypatch.setattr(sse_chunks, "json_string", json.dumps)  # ensure_ascii: \u00e9
    assert chunks.event(0, "é \"q\"") != expected
    monkeypatch.setattr(sse_chunks, "json_string", lambda text: f'"{text}"')  # no escaping
    assert chunks.event(0, "é \"q\"") != expected
    assert chunks.event(0, "plain") == event(_chat(0, "plain"), True)


def test_placeholder_found_more_than_once_is_refused():
    def build(index: int, text: str) -> ChatCompletionChunk:  # the text as the id as well
        return ChatCompletionChunk(id=text, created=1, model="m",
                                   choices=[ChatChunkChoice(index=index, delta={"content": text})])

    chunks = TextChunks(build, True)
    with pytest.raises(RuntimeError, match="placeholder"):
        chunks.event(0, "hi")
