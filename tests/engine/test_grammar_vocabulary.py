"""llguidance's view of a vocabulary built from the tokens' bytes (engine/grammar/vocabulary.py)
equals the one llguidance builds from the tokenizer's JSON: every token's bytes and special
flag, tokenizations, and the token masks along a walk through grammars."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.grammar import vocabulary
from engine.grammar.vocabulary import grammar_tokenizer, token_bytes, tokenizes_fragments_as_is
from tests.engine.tiny_tokenizers import CORPUS, EOS, TEXTS, train_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
WALKS = [(SCHEMA, '{"name": "Café 😀 x", "n": 42}'), ({"type": "string", "pattern": "[a-zé]+"},
                                                       '"crème"')]


def byte_fallback_tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE as Llama 2's and Mistral's tokenizer.json have it: Metaspace,
    `<0xNN>` tokens for bytes outside the vocabulary, a Replace/ByteFallback/Fuse decoder."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", EOS]))
    state = json.loads(trained.model.__getstate__())
    vocab = state["vocab"]
    for byte in range(256):  # byte tokens are plain vocabulary entries, as in Llama 2's
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", EOS])
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme, split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_tokens(["<tool>", "plain-added"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(default_model_folder):
    from transformers import AutoTokenizer

    return {"default model": AutoTokenizer.from_pretrained(default_model_folder),
            "byte level": train_tokenizer(normalized=False),
            "byte fallback": byte_fallback_tokenizer("never")}


def _reference(tokenizer, n_vocab):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                        eos_token=tokenizer.eos_token_id)


def _masks_along(ll_tokenizer, tokenizer, schema, text) -> list[bytes]:
    import llguidance
    import llguidance.numpy
    import numpy as np

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        schema), log_level=0)
    masks = []
    bitmask = np.zeros((1, (ll_tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(bitmask.tobytes())
        if not matcher.consume_token(token):
            return [*masks, b"refused"]
    return masks


@pytest.mark.parametrize("name", ["default model", "byte level", "byte fallback"])
def test_the_view_from_bytes_equals_llguidance_s_own(tokenizers, name):
    tokenizer = tokenizers[name]
    n_vocab = len(tokenizer) + 5  # an LM head wider than the tokenizer: padded the same way
    assert tokenizes_fragments_as_is(tokenizer.backend_tokenizer)
    ours, reference = grammar_tokenizer(tokenizer, n_vocab, None), _reference(tokenizer, n_vocab)
    assert type(ours).__name__ == "LLTokenizer"
    assert (ours.vocab_size, ours.eos_tokens, ours.is_canonical) == \
        (reference.vocab_size, reference.eos_tokens, reference.is_canonical)
    for token in range(n_vocab):
        assert ours.decode_bytes([token]) == reference.decode_bytes([token]), token
        assert ours.is_special_token(token) == reference.is_special_token(token), token
    for text in [*TEXTS, f"a{EOS}b <tool> plain-added"]:
        for special in (False, True):
            assert ours.tokenize_str(text, parse_special=special) == \
                reference.tokenize_str(text, parse_special=special), text
    for schema, text in WALKS:
        masks = _masks_along(reference, tokenizer, schema, text)
        assert b"refused" not in masks and len(set(masks)) >= 3  # the walk sees several masks
        assert _masks_along(ours, tokenizer, schema, text) == masks


def test_the_comparison_sees_wrong_bytes(tokenizers, monkeypatch):
    """The control: byte-level tokens read as their characters' UTF-8 (no alphabet) give another
    view, and the same checks tell it apart."""
    tokenizer = tokenizers["default model"]
    identity = {chr(c): c for c in range(256)}
    monkeypatch.setattr(vocabulary, "_byte_level_alphabet", lambda: identity)
    ours, reference = grammar_tokenizer(tokenizer, len(tokenizer), None), \
        _reference(tokenizer, len(tokenizer))
    space_token = tokenizer.convert_tokens_to_ids("Ġthe")
    assert ours.decode_bytes([space_token]) != reference.decode_bytes([space_token])
    assert _masks_along(ours, tokenizer, *WALKS[0]) != \
        _masks_along(reference, tokenizer, *WALKS[0])


def test_specials_and_byte_tokens_are_read_as_llguidance_reads_them(tokenizers):
    tokens = token_bytes(tokenizers["byte fallback"].backend_tokenizer)
    tokenizer = tokenizers["byte fallback"]
    assert tokens[tokenizer.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert tokens[tokenizer.convert_tokens_to_ids(EOS)] == b"\xff" + EOS.encode()
    assert tokens[tokenizer.convert_tokens_to_ids("<tool>")] == b"\xff<tool>"  # <...>: special
    assert tokens[tokenizer.convert_tokens_to_ids("plain-added")] == b"plain-added"


def test_tokenizers_that_prepend_a_space_take_the_json_path(tokenizers, monkeypatch):
    """A Metaspace pre-tokenizer that prepends "▁" tokenizes a fragment unlike llguidance's copy
    (which never prepends): the view is llguidance's own. The control: the server's tokenizer
    does tokenize a fragment differently there."""
    tokenizer = byte_fallback_tokenizer("first")
    assert not tokenizes_fragments_as_is(tokenizer.backend_tokenizer)
    assert tokenizes_fragments_as_is(tokenizers["byte fallback"].backend_tokenizer)
    built = []
    monkeypatch.setattr(vocabulary, "token_bytes", lambda backend: built.append(backend))
    ll_tokenizer = grammar_tokenizer(tokenizer, len(tokenizer), None)
    assert built == []  # the bytes were never read: llguidance built it from JSON
    fragment = "weather"
    assert tokenizer.backend_tokenizer.encode(fragment, add_special_tokens=False).ids != \
        ll_tokenizer.tokenize_str(fragment)


def test_a_decoder_of_another_kind_takes_the_json_path():
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    assert token_bytes(backend) is None


def test_a_slow_tokenizer_gets_llguidance_s_own_refusal():
    """No `backend_tokenizer`: llguidance's path, and its ValueError, as before this module."""
    class Slow:
        eos_token_id = 0

    with pytest.raises(ValueError, match="fast tokenizers"):
        grammar_tokenizer(Slow(), 10, None)
