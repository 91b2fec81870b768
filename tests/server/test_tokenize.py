"""`/tokenize`, `/detokenize` (vLLM's shape) and `usage.prompt_tokens_details.cached_tokens`
against the shared default-model server."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import assert_error


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    return AutoTokenizer.from_pretrained(default_model_folder)


def _post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_and_back(server, tokenizer):
    text = "The quick brown fox"
    body = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    expected = tokenizer(text)["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    assert _post(server, "/detokenize", {"tokens": expected}).json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_counts(server, tokenizer):
    messages = [{"role": "user", "content": "Hello!"}]
    counted = _post(server, "/tokenize", {"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert counted["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == counted["count"]
    without = _post(server, "/tokenize", {"messages": messages,
                                          "add_generation_prompt": False}).json()
    assert without["count"] < counted["count"]  # the control: the flag changes the text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [10**9]}, "tokens.0"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, param):
    response = _post(server, path, body)
    assert_error(response, 404 if param == "model" else 400, param)


def test_cached_tokens_count_the_prefix_a_repeated_prompt_finds(server):
    """Whole and streamed, chat and completions; the control: a prompt never seen before
    starts (by its unique first words) with nothing cached."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    prompt = f"{uuid.uuid4().hex} " + "tell me about the sea and the sky " * 6
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached <= again.usage.prompt_tokens and cached % 16 == 0
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=1,
                                       stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == cached

    messages = [{"role": "user", "content": prompt + " again"}]
    chat_first = client.chat.completions.create(model=server.model, messages=messages,
                                                max_tokens=1)
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1,
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens > \
        chat_first.usage.prompt_tokens_details.cached_tokens
