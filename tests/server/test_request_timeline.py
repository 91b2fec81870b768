"""A served request's timeline in /metrics: each span observed once per request, and the spans
adding up (front + queue + prefill = TTFT; TTFT written - prefill = the server's overhead)."""

from __future__ import annotations

import httpx

from tests.servers import wait_until

# Histograms each request enters exactly once (a request that got at least one token and was
# written in full).
ENGINE_SPANS = ("time_to_first_token_seconds", "request_queue_time_seconds",
                "request_prefill_time_seconds", "request_front_time_seconds",
                "request_tokenize_time_seconds", "e2e_request_latency_seconds",
                "request_inference_time_seconds")
DELIVERY_SPANS = ("request_first_token_write_delay_seconds",
                  "request_last_token_write_delay_seconds",
                  "time_to_first_token_written_seconds", "request_first_token_overhead_seconds")
TOLERANCE_S = 1e-6  # the spans are differences of the same stamps: equal up to float rounding


def _growth(before: dict, after: dict, name: str) -> tuple[float, float]:
    """(observations, seconds) a histogram gained."""
    return (after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0),
            after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0))


def _delivered(server, before: dict, count: int) -> dict:
    """/metrics once the routes have reported `count` more written responses (a response that
    is not streamed reports after its body is sent, which may be after the client read it)."""
    name = "time_to_first_token_written_seconds_count"
    wait_until(lambda: server.metrics().get(name, 0) - before.get(name, 0) >= count, 10,
               "the delivery spans")
    return server.metrics()


def _chat(server, stream: bool, n: int = 1) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": stream, "n": n}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        text = "".join(response.iter_text())
    assert ("data: [DONE]" in text) == stream


def test_streamed_chat_enters_each_span_once_and_the_spans_add_up(server):
    before = server.wait_until_idle()
    _chat(server, stream=True)
    after = _delivered(server, before, 1)
    spans = {name: _growth(before, after, name)
             for name in ENGINE_SPANS + DELIVERY_SPANS + ("request_template_time_seconds",)}
    assert {name: count for name, (count, _) in spans.items()} == dict.fromkeys(spans, 1)
    seconds = {name: total for name, (_, total) in spans.items()}
    front, queue, prefill = (seconds["request_front_time_seconds"],
                             seconds["request_queue_time_seconds"],
                             seconds["request_prefill_time_seconds"])
    ttft = seconds["time_to_first_token_seconds"]
    assert abs(ttft - (front + queue + prefill)) < TOLERANCE_S
    # The template and the tokenizer are parts of the front.
    assert (seconds["request_template_time_seconds"]
            + seconds["request_tokenize_time_seconds"]) <= front + TOLERANCE_S
    written = seconds["time_to_first_token_written_seconds"]
    assert abs(written - (ttft + seconds["request_first_token_write_delay_seconds"])) \
        < TOLERANCE_S
    assert abs(seconds["request_first_token_overhead_seconds"] - (written - prefill)) \
        < TOLERANCE_S
    assert 0 < prefill < ttft < seconds["e2e_request_latency_seconds"]


def test_each_choice_is_one_request_in_the_spans(server):
    before = server.wait_until_idle()
    _chat(server, stream=True, n=2)
    after = _delivered(server, before, 2)
    for name in ENGINE_SPANS + DELIVERY_SPANS:
        assert _growth(before, after, name)[0] == 2, name


def test_a_response_that_is_not_streamed_is_written_whole(server):
    before = server.wait_until_idle()
    _chat(server, stream=False)
    after = _delivered(server, before, 1)
    for name in ENGINE_SPANS + DELIVERY_SPANS:
        assert _growth(before, after, name)[0] == 1, name
    # Every token went in the one body, first and last at the same moment: their write delays
    # differ by the time between the first and the last token sampled, the decode (which ends
    # at the finish, stamped a moment before the last token's sample time).
    first_to_last_sampled = (
        _growth(before, after, "request_first_token_write_delay_seconds")[1]
        - _growth(before, after, "request_last_token_write_delay_seconds")[1])
    decode = _growth(before, after, "request_decode_time_seconds")[1]
    assert abs(first_to_last_sampled - decode) < 0.005


def test_completions_have_no_template_span(server):
    before = server.wait_until_idle()
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "stream": True})
    assert response.status_code == 200, response.text
    after = _delivered(server, before, 1)
    assert _growth(before, after, "request_template_time_seconds")[0] == 0
    for name in ENGINE_SPANS + DELIVERY_SPANS:
        assert _growth(before, after, name)[0] == 1, name
