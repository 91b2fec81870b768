"""Incremental detokenization of generated tokens, with stop strings, for streaming responses.

Decoding the whole output after every step costs O(n) per token, and decoding each token on its
own is wrong: SentencePiece decoders drop the leading space of the first token of a sequence, and
byte-level BPE can split one multi-byte UTF-8 character across several tokens. So we decode a
small sliding window instead: a few tokens already shown (the "prefix", used only as context)
followed by the tokens not shown yet, and emit the part of the window's text past the prefix's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the window: enough for any decoder's leading-space rule, and the
# window stays a handful of tokens wide.
PROMPT_CONTEXT_TOKENS = 5

# What a decoder writes for bytes that are not (yet) a complete UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, safely for streaming.

    Every delta is final: no later token changes it. Two things are held back: a character whose
    bytes have not all arrived (the window's text ends with U+FFFD), and the longest tail of the
    text that could still be the start of a stop string. `flush()` releases both at the end.

    When no stop string matches, the deltas plus `flush()` concatenate to
    `tokenizer.decode(generated_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`,
    except that the first token keeps a leading space a SentencePiece decoder would strip at the
    start of a sequence: it is decoded as it reads after the prompt.

    With several stop strings, the match that completes first in the text wins (ties: the one
    starting first). That is what a reader of the text character by character would see, so the
    result does not depend on how tokens are grouped into `append()` calls.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """`prompt_token_ids` only seeds decoding context; its text is never part of the output.

        Raises ValueError on an empty stop string (it would match before any output).
        """
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust decoder, called directly: it is what `tokenizer.decode` calls
        # with no clean-up, minus ~15 us of Python around it, twice per token of every stream.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # The window: tokens from the prefix offset on; `_read` (window-relative read offset)
        # splits the context tokens, already shown, from those whose text is not final yet.
        # Tokens before the window are dropped, so memory stays constant too.
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        # Characters past `_prefix_text` already moved to `_output` while the window still ended
        # in an incomplete character (so the window could not slide yet).
        self._emitted = 0

        self._output = ""  # decoded, final text; its tail may still be held back for stops
        self._returned = 0  # how much of `_output` the caller has received
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """All visible output text so far: everything returned by `append()`/`flush()`.

        Never includes a matched stop string, nor text still held back.
        """
        return self._output[: self._returned]

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, else None."""
        return self._stop_reason

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the text that became final and visible (may be '').

        Returns '' once a stop string has matched. Raises RuntimeError after `flush()`.
        """
        if self._flushed:
            raise RuntimeError("append() after flush()")
        if self._stop_reason is not None or not new_token_ids:
            # An empty append must not slide the window: that would leave it without context.
            return ""
        self._window.extend(new_token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At finish (no stop string matched): returns any held-back text.

        Incomplete characters are emitted as U+FFFD, as a full decode would show them. Returns ''
        after a stop string matched, or on a second call.
        """
        if self._flushed or self._stop_reason is not None:
            self._flushed = True
            return ""
        self._flushed = True
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        # No clean-up: it rewrites spaces around punctuation depending on what surrounds them,
        # which a window cannot know; the raw text concatenates exactly.
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self, final: bool) -> str:
        """Decodes the window; returns its newly final text and slides the window when it can."""
        window_text = self._decode(self._window)
        # The window starts with the prefix tokens, so its text starts with the prefix's text.
        tail = window_text[len(self._prefix_text) :]
        if not final and window_text.endswith(REPLACEMENT_CHAR):
            # The last character is incomplete; everything before it can no longer change. The
            # window must not slide (its next start would be mid-character), so remember how much
            # of it has gone out. A run of U+FFFD may also hold genuinely invalid bytes: holding
            # them until more text arrives is harmless.
            stable = tail.rstrip(REPLACEMENT_CHAR)
            new_text = stable[self._emitted :]
            self._emitted = max(self._emitted, len(stable))
            return new_text
        new_text = tail[self._emitted :]
        # Clean character boundary: the tokens just shown become the next window's context.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._emitted = 0
        return new_text

    def _release(self, new_text: str, final: bool) -> str:
        """Adds final text to the output, checks stop strings, returns what may be shown now."""
        previous_len = len(self._output)
        self._output += new_text
        match = self._find_stop(previous_len)
        if match is not None:
            start, stop = match
            self._output = self._output[:start]
            self._stop_reason = stop
            # Defensive: a match never starts inside returned text, as its start was held back.
            end = max(start, self._returned)
        else:
            end = len(self._output) - (0 if final else self._held_back_len())
        delta = self._output[self._returned : end]
        self._returned = max(end, self._returned)
        return delta

    def _find_stop(self, previous_len: int) -> tuple[int, str] | None:
        """Returns (start, stop) of the first stop string completing past `previous_len`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # A match ending within the old text would have been found by an earlier call.
            start = self._output.find(stop, max(0, previous_len - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _held_back_len(self) -> int:
        """Length of the longest unreturned tail of the output that starts some stop string."""
        # Only proper prefixes matter: a whole stop string would already have matched.
        longest = min(self._max_stop_len - 1, len(self._output) - self._returned)
        for k in range(longest, 0, -1):
            suffix = self._output[-k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0
