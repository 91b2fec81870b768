"""Misuse gets OpenAI's error envelope with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import assert_error

CHAT = [{"role": "user", "content": "Hi"}]


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs)


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe"])
def test_malformed_json_is_400(server, content):
    response = _post(server, "/v1/completions", content=content,
                     headers={"Content-Type": "application/json"})
    assert "JSON" in assert_error(response, 400)["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": {"yes": 1}}, "stream"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
])
def test_wrong_types_are_400(server, path, body, param):
    assert_error(_post(server, path, json=body), 400, param=param)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", 0), ("temperature", 2.5), ("top_p", 1.5), ("n", 1000),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("logprobs", 6),
    ("stop", ["a", "b", "c", "d", "e"]), ("logit_bias", {"5": 101}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"dog": 1}), ("top_p", 0),
])
def test_out_of_range_completion_values_are_400(server, field, value):
    response = _post(server, "/v1/completions", json={"prompt": "x", field: value})
    assert_error(response, 400, param=field)


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
])
def test_out_of_range_chat_values_are_400(server, body, param):
    response = _post(server, "/v1/chat/completions", json={"messages": CHAT, **body})
    assert_error(response, 400, param=param)


def test_prompt_plus_max_tokens_past_the_context_names_both_numbers(server):
    response = _post(server, "/v1/completions", json={"prompt": "Hello", "max_tokens": 9000})
    message = assert_error(response, 400)["message"]
    assert "8192" in message and "9000" in message
    response = _post(server, "/v1/chat/completions",
                     json={"messages": CHAT, "max_completion_tokens": 8190})
    message = assert_error(response, 400)["message"]
    assert "8192" in message and "8190" in message


def test_empty_prompt_is_400(server):
    assert_error(_post(server, "/v1/completions", json={"prompt": ""}), 400)
    assert_error(_post(server, "/v1/completions", json={"prompt": []}), 400, param="prompt")


def test_unknown_model_is_404(server):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})]:
        response = _post(server, path, json={"model": "gpt-5", **body})
        assert_error(response, 404, param="model", code="model_not_found")
    response = httpx.get(f"{server.base_url}/v1/models/gpt-5")
    assert_error(response, 404, code="model_not_found")
    assert_error(httpx.get(f"{server.base_url}/v1/nowhere"), 404)


def test_the_sdk_raises_its_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-5", prompt="x")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=server.model, messages=CHAT, temperature=3)
    assert bad.value.param == "temperature"


def test_unknown_fields_are_ignored_and_the_server_keeps_serving(server):
    response = _post(server, "/v1/completions",
                     json={"prompt": "Hello", "max_tokens": 2, "suffix_unknown": 1,
                           "user": "someone", "frobnicate": {"a": [1]}})
    assert response.status_code == 200, response.text
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [server.model]
    card = httpx.get(f"{server.base_url}/v1/models/{server.model}").json()
    assert card["object"] == "model" and card["id"] == server.model
