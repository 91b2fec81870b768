"""Bodies a client can use against the server, from outside: JSON nested 100,000 levels deep is a
400 in OpenAI's envelope (not a 500 "maximum recursion depth exceeded"), and a body past
--max-request-bytes is a 413, whether it declares its length or arrives chunked."""

from __future__ import annotations

import httpx
import pytest

from server.context import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import API_KEY, assert_error

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
DEPTH = 100_000


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [
    "[" * DEPTH + "]" * DEPTH,
    '{"prompt": ' + "[" * DEPTH + "]" * DEPTH + "}",
    '{"a": ' * DEPTH + "1" + "}" * DEPTH,
], ids=["arrays", "arrays-in-a-field", "objects"])
def test_deeply_nested_json_is_a_400(guarded_server, route, body):
    response = httpx.post(f"{guarded_server.base_url}{route}", content=body, headers=AUTH,
                          timeout=30)
    error = assert_error(response, 400)
    assert "nested too deeply" in error["message"]


def test_a_body_over_the_limit_is_a_413(guarded_server):
    body = b'{"model": "tiny", "prompt": "' + b"x" * DEFAULT_MAX_REQUEST_BYTES + b'"}'
    response = httpx.post(f"{guarded_server.base_url}/v1/completions", content=body,
                          headers=AUTH, timeout=30)
    assert_error(response, 413, code="request_too_large")


def test_a_chunked_body_over_the_limit_is_a_413(guarded_server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    response = httpx.post(f"{guarded_server.base_url}/v1/completions", content=chunks(),
                          headers=AUTH, timeout=30)
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")


def test_a_body_just_under_the_limit_is_served(guarded_server):
    """Whitespace is valid JSON: a large body that is not too large is answered normally."""
    head = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1}'
    body = head + b" " * (DEFAULT_MAX_REQUEST_BYTES - len(head))
    response = httpx.post(f"{guarded_server.base_url}/v1/completions", content=body,
                          headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
