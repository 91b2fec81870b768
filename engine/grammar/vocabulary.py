"""llguidance's view of a vocabulary, built from the tokens' bytes rather than from the tokenizer's
JSON.

`llguidance.hf.from_tokenizer` serializes the whole Hugging Face tokenizer to JSON and parses it
again in Rust: a second copy of the tokenizer (vocabulary and merges) that llguidance keeps for
its own tokenizing. For the default model's 49,152 tokens that view holds ~38 MB of resident
memory, and its build takes 0.34-0.39 s, 0.21-0.24 s of it holding the GIL (AMD EPYC Zen 4).
Given the bytes of every token and a callback into the tokenizer the server already has,
llguidance builds the same view in ~17 MB, in 0.21-0.25 s, holding the GIL for 0.09-0.12 s of it.
The server builds it on the first structured request (on a compiling thread; the event loop
pauses once, for that hold) rather than at start, where it would cost every server its memory.

The bytes follow the rules llguidance applies to tokenizer JSON: a byte-level decoder maps
characters back through GPT-2's byte alphabet; a byte-fallback decoder reads `<0xNN>` tokens as
bytes and its replacement character as a space; special added tokens (and added `<...>` ones)
are marked with llguidance's 0xFF prefix, other added tokens are their text.
tests/engine/test_grammar_vocabulary.py checks every token, tokenizations and masks equal to the
JSON path's.

Tokenizers whose fragments would be tokenized differently by the server's own tokenizer (one
that prepends a space, or truncates), decoders of other kinds and slow tokenizers take
llguidance's own path (which refuses slow ones, as before).
"""

from __future__ import annotations

import functools
import json

SPECIAL_MARKER = b"\xff"  # llguidance's prefix for special tokens' bytes


def grammar_tokenizer(hf_tokenizer, n_vocab: int, eos_token_ids: list[int] | None):
    """An `llguidance.LLTokenizer` for a fast Hugging Face tokenizer."""
    import llguidance
    import llguidance.hf

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer
    tokens = token_bytes(backend) if backend is not None and tokenizes_fragments_as_is(
        backend) else None
    if tokens is None:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                            eos_token=eos_token_ids)
    # Rows of the LM head past the tokenizer's tokens: special placeholders, as llguidance pads.
    tokens += [SPECIAL_MARKER + b"<[%d]>" % i for i in range(len(tokens), n_vocab)]
    vocabulary = _Vocabulary(backend, tokens, hf_tokenizer.eos_token_id)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=n_vocab,
                                  eos_token=eos_token_ids)


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads: the tokens' bytes, the special ids, and a
    tokenize callback (called with text; bytes are refused, so the wrapper decodes first)."""

    def __init__(self, backend, tokens: list[bytes], eos_token_id: int | None):
        self._backend = backend
        self.tokens = tokens
        self.special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == SPECIAL_MARKER]
        self.eos_token_id = eos_token_id
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._backend.encode(text, add_special_tokens=False).ids


def token_bytes(backend) -> list[bytes] | None:
    """Every token's bytes (special ones behind SPECIAL_MARKER), or None for a decoder that is
    neither byte-level nor byte-fallback."""
    decoding = _decoding(_state(backend.decoder))
    if decoding is None:
        return None
    byte_level, byte_fallback, space = decoding
    added = backend.get_added_tokens_decoder()
    specials = {i for i, token in added.items() if token.special
                or (token.content.startswith("<") and token.content.endswith(">"))}
    byte_of = _byte_level_alphabet()
    tokens = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        name = backend.id_to_token(token_id)
        if name is None:
            tokens.append(b"")
        elif token_id in specials:
            tokens.append(SPECIAL_MARKER + name.encode())
        elif token_id in added:
            tokens.append(added[token_id].content.encode())
        elif byte_fallback and len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
            tokens.append(bytes([int(name[3:5], 16)]))
        elif byte_fallback:
            tokens.append(name.replace(space, " ").encode())
        elif byte_level and all(c in byte_of for c in name):
            tokens.append(bytes(byte_of[c] for c in name))
        else:
            tokens.append(b"")  # a character outside the byte alphabet: no bytes, as llguidance
    return tokens


def tokenizes_fragments_as_is(backend) -> bool:
    """Whether encoding a fragment with `backend` is what llguidance's own copy would do: its
    copy drops `Prepend` normalizers, sets Metaspace's prepend scheme to never, and neither
    truncates nor pads."""
    if backend.truncation is not None or backend.padding is not None:
        return False
    components = _flatten(_state(backend.normalizer)) + _flatten(_state(backend.pre_tokenizer))
    return not any(c.get("type") == "Prepend" or (c.get("type") == "Metaspace"
                   and c.get("prepend_scheme", "always") != "never") for c in components)


def _decoding(decoder: dict | None) -> tuple[bool, bool, str] | None:
    """(byte level, byte fallback, the character that stands for a space)."""
    byte_level, byte_fallback, space = False, False, " "
    for part in _flatten(decoder):
        byte_level |= part.get("type") == "ByteLevel"
        byte_fallback |= part.get("type") == "ByteFallback"
        pattern = (part.get("pattern") or {}).get("String")
        if part.get("type") == "Replace" and part.get("content") == " " and pattern \
                and len(pattern) == 1:
            space = pattern
    # As llguidance: a top-level ByteLevel decoder, or one inside a Sequence.
    return (byte_level, byte_fallback, space) if byte_level or byte_fallback else None


def _state(component) -> dict | None:
    """A tokenizer component's JSON (small: the vocabulary lives in the model, not here)."""
    return None if component is None else json.loads(component.__getstate__())


def _flatten(state: dict | None) -> list[dict]:
    if state is None:
        return []
    children = state.get("decoders") or state.get("normalizers") or state.get("pretokenizers")
    if state.get("type") == "Sequence" and children is not None:
        return [part for child in children for part in _flatten(child)]
    return [state]


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the others take the characters from U+0100 on, in byte order."""
    alphabet, next_char = {}, 0x100
    for byte in range(256):
        if 0x21 <= byte <= 0x7E or 0xA1 <= byte <= 0xAC or 0xAE <= byte <= 0xFF:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(next_char)] = byte
            next_char += 1
    return alphabet
