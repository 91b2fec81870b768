"""The steady-state chunk of a stream, rendered without pydantic.

Nearly every event of a streamed chat or completion is the same chunk with a different text: one
choice, its text, no logprobs, no finish reason. Building the pydantic models and dumping them for
each such chunk is most of what a token costs the event loop. `TextChunks` renders that chunk once
per choice index through pydantic with a placeholder text, keeps the JSON before and after the
placeholder, and from then on writes prefix + the text as a JSON string + suffix. The bytes are
pydantic's own (tests/server/test_sse_fast_path.py checks them against `model_dump_json` for many
texts); every other chunk (role, tool calls, logprobs, finish, usage) still goes through pydantic.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from json.encoder import encode_basestring

from pydantic import BaseModel

from server.streaming import event

# `json.dumps(text, ensure_ascii=False)` without the encoder object: the C function it ends in.
# Like pydantic's JSON (serde_json), it writes non-ASCII as UTF-8 and escapes `"`, `\\` and the
# control characters (\b \f \n \r \t by name, the rest as lowercase \u00XX).
json_string: Callable[[str], str] = encode_basestring


class TextChunks:
    """SSE events of one stream's text-only chunks, byte for byte what
    `event(build(index, text), with_usage)` would give."""

    def __init__(self, build: Callable[[int, str], BaseModel], with_usage: bool):
        """`build(index, text)`: the chunk model of choice `index` carrying `text` and nothing
        else that varies."""
        self._build = build
        self._with_usage = with_usage
        self._around: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        around = self._around.get(index)
        if around is None:
            around = self._around[index] = self._split(index)
        return around[0] + json_string(text) + around[1]

    def _split(self, index: int) -> tuple[str, str]:
        """The event's text before and after the chunk's text, found by rendering a placeholder
        that cannot occur elsewhere in the chunk (ids and model names have no such uuid)."""
        placeholder = f"text-{uuid.uuid4().hex}"
        rendered = event(self._build(index, placeholder), self._with_usage)
        quoted = json.dumps(placeholder)
        if rendered.count(quoted) != 1:
            raise RuntimeError(f"the chunk template holds its placeholder "
                               f"{rendered.count(quoted)} times, not once")
        before, after = rendered.split(quoted)
        return before, after
