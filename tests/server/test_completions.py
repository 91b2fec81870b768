"""POST /v1/completions against the real default model, through the openai SDK and raw HTTP."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.server.conftest import sse_events

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _complete(server, **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions",
                          json={"model": server.model, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_shape_and_usage(client, server):
    completion = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                           temperature=0)
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.model == server.model and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert choice.text and choice.logprobs is None
    usage = completion.usage
    assert usage.prompt_tokens == 5 and 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    speculative = usage.model_extra["speculative"]
    assert set(speculative) == {"num_drafts", "draft_tokens", "accepted_tokens",
                                "mean_acceptance_length", "by_method"}
    assert set(speculative["by_method"]) <= {"ngram"}  # the default method's guesses
    assert 0 <= speculative["accepted_tokens"] <= speculative["draft_tokens"]


def test_prompt_forms_and_n_fan_out(server):
    # Two string prompts, two choices each: indices are prompt_index * n + j.
    body = _complete(server, prompt=[PROMPT, "def fib(n):"], n=2, max_tokens=4, temperature=0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the n choices agree
    # Token ids give the same output as the text they encode.
    from_text = _complete(server, prompt=PROMPT, max_tokens=4, temperature=0)
    token_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    from_ids = _complete(server, prompt=token_ids, max_tokens=4, temperature=0)
    from_id_lists = _complete(server, prompt=[token_ids], max_tokens=4, temperature=0)
    assert from_text["choices"][0]["text"] == from_ids["choices"][0]["text"] \
        == from_id_lists["choices"][0]["text"] == texts[0]


def test_stop_string_ends_the_text_before_it(server):
    full = _complete(server, prompt=PROMPT, max_tokens=10, temperature=0)["choices"][0]["text"]
    stop = full.split()[1]  # the second word of the greedy continuation
    stopped = _complete(server, prompt=PROMPT, max_tokens=10, temperature=0,
                        stop=[stop, "never-seen-xyz"])["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full[:full.index(stop)]


def test_seed_makes_sampling_reproducible(server):
    def sample(seed):
        return _complete(server, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                         seed=seed)["choices"][0]["text"]

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_echo_prepends_the_prompt(server):
    body = _complete(server, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = _complete(server, prompt=PROMPT, max_tokens=3, temperature=0)
    assert body["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


def test_logprobs_legacy_columns(server):
    body = _complete(server, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    count = body["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == count
    assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == count
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][0] == 0
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs["top_logprobs"]):
        assert value <= 0 and 2 <= len(top) <= 3
        assert top[token] == value == max(top.values())  # greedy picks the most likely token
    # With echo, the prompt's tokens come first, unscored.
    echoed = _complete(server, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0,
                       echo=True)["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][:5] == [None] * 5 and echoed["top_logprobs"][0] is None
    assert echoed["text_offset"][:2] == [0, 3]


def test_streaming_matches_the_whole_response(server):
    whole = _complete(server, prompt=PROMPT, max_tokens=8, temperature=0)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=120,
                      json={"model": server.model, "prompt": PROMPT, "max_tokens": 8,
                            "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw.split("\n\n"))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streaming_with_usage_through_the_sdk(client, server):
    stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, n=2,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == 5
    assert all(c.usage is None for c in content)
    finished = {c.choices[0].index: c.choices[0].finish_reason
                for c in content if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_n_choices_share_the_prompts_cached_blocks(server):
    # A prompt no other test sends, three full KV blocks long at least.
    prompt = f"Request {uuid.uuid4().hex}: " + "tell me about the sea and the sky, " * 6
    before = server.metrics()
    body = _complete(server, prompt=prompt, n=3, max_tokens=2, temperature=0)
    after = server.metrics()
    assert len(body["choices"]) == 3
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    # The first choice prefills the prompt; the other two find its full blocks cached.
    assert hits >= 2 * 16 * ((body["usage"]["prompt_tokens"] - 1) // 16)
