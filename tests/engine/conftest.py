"""Fixtures of the engine tests: tiny in-memory tokenizers."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.engine.tiny_tokenizers import train_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(normalized=False)


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(normalized=True)
