"""Responses API latency against chat completions at batch 1, on a running server: the same
prompt, greedy, the same number of output tokens (ignore_eos is not a Responses field, so a long
`max_output_tokens` on a prompt that runs long is what keeps lengths equal; the output token
counts are printed to check). Interleaved A/B rounds; JSON on stdout.

    python -m benchmarks.responses_latency --base-url http://127.0.0.1:8000 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

PROMPT = "Count from one to one hundred in words, separated by commas."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    model = httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    chat = ("/v1/chat/completions", {"model": model, "temperature": 0,
                                     "messages": [{"role": "user", "content": PROMPT}],
                                     "max_tokens": args.max_tokens})
    responses = ("/v1/responses", {"model": model, "temperature": 0, "input": PROMPT,
                                   "max_output_tokens": args.max_tokens})  # stored, the default
    unstored = ("/v1/responses", {**responses[1], "store": False})
    seconds = {"chat": [], "responses": [], "responses_unstored": []}
    tokens = {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=120) as client:
        for _ in range(args.rounds + 1):  # the first round warms up, and is dropped
            for name, (path, body) in (("chat", chat), ("responses", responses),
                                       ("responses_unstored", unstored)):
                started = time.perf_counter()
                reply = client.post(path, json=body).raise_for_status().json()
                seconds[name].append(time.perf_counter() - started)
                usage = reply["usage"]
                tokens[name] = usage.get("completion_tokens", usage.get("output_tokens"))
    median = {name: statistics.median(values[1:]) for name, values in seconds.items()}
    print(json.dumps({"benchmark": "responses_latency", "rounds": args.rounds,
                      "output_tokens": tokens, "median_s": median,
                      "responses_over_chat": median["responses"] / median["chat"],
                      "unstored_over_chat": median["responses_unstored"] / median["chat"]},
                     indent=2))


if __name__ == "__main__":
    main()
