"""POST /v1/chat/completions against the real default model, through the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import sse_events

MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_shape(client, server):
    completion = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                                max_tokens=6, temperature=0)
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion" and completion.model == server.model
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant" and choice.message.content
    usage = completion.usage
    assert usage.prompt_tokens > 10 and 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert "speculative" in usage.model_extra


def test_stream_carries_the_role_first_then_finish_then_usage(client, server):
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    *content, final, usage_chunk = chunks
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content)
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert usage_chunk.choices == []
    # Token counts match; the speculation counts under usage.speculative need not: the adaptive
    # controller drafts by measured step times, which differ between the two requests.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage_chunk.usage, n) for n in counts] == [getattr(whole.usage, n)
                                                                for n in counts]


def test_stream_without_usage_ends_with_done(server):
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 3, "stream": True}) as response:
        raw = "".join(response.iter_text())
    events = sse_events(raw.split("\n\n"))
    assert events[-1] == "[DONE]" and raw.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_choices_with_a_seed_differ_and_reproduce(client, server):
    def sample():
        completion = client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_completion_tokens=8, temperature=1.0,
            n=3, seed=7)
        assert [c.index for c in completion.choices] == [0, 1, 2]
        assert 3 <= completion.usage.completion_tokens <= 24
        return [c.message.content for c in completion.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1


def test_logprobs_with_top_alternatives(client, server):
    completion = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one was chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_text_parts_equal_plain_content(client, server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital of France?"}]
    replies = [client.chat.completions.create(model=server.model, messages=m, max_tokens=5,
                                              temperature=0).choices[0].message.content
               for m in (parts, plain)]
    assert replies[0] == replies[1]
