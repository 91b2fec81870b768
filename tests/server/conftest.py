"""Real server processes on free loopback ports, started once and shared.

`server` (tests/conftest.py) serves the embedded default model with the default speculative
method (what `specserve serve` does with no arguments); `guarded_server` serves a tiny random
model behind an API key from the environment, with one batch slot and a queue of one (so
busy-server paths are easy to reach) and vLLM's metric names.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.servers import running_server

API_KEY = "test-secret-key"


@pytest.fixture(scope="session")
def long_context_tiny_model(tmp_path_factory, default_model_folder):
    """A tiny random Llama with the default tokenizer and room for thousands of tokens."""
    folder = tmp_path_factory.mktemp("tiny-long")
    make_tiny_model(folder, vocab_size=49152, tokenizer_from=default_model_folder,
                    eos_token_id=2, bos_token_id=1, max_position_embeddings=8192)
    return folder


@pytest.fixture(scope="session")
def guarded_server(long_context_tiny_model):
    args = ["--model", str(long_context_tiny_model), "--max-num-seqs", "1", "--max-queue", "1",
            "--speculative-method", "none", "--served-model-name", "tiny",
            "--metrics-prefix", "vllm"]
    with running_server(args, "tiny", env={"SPECSERVE_API_KEY": API_KEY},
                        metrics_prefix="vllm") as running:
        yield running


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    """The response is OpenAI's error envelope with this status; returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE stream, in order ("[DONE]" included)."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# A small KV cache (64 blocks of 16 tokens) so that a few long prompts exhaust it.
FAULT_SERVER_KV_BLOCKS = 64


@pytest.fixture(scope="session")
def fault_server(long_context_tiny_model, tmp_path_factory):
    """A tiny model with the per-request faults armed (engine/faults.py: they fire only on
    requests whose prompt holds their marker), 8 batch slots and a KV cache that a few long
    prompts exhaust: the fault matrix and the hostile grammars share it."""
    from engine.faults import FAULT_ENV

    log_path = tmp_path_factory.mktemp("fault-server") / "server.log"
    args = ["--model", str(long_context_tiny_model), "--served-model-name", "tiny",
            "--speculative-method", "ngram", "--max-num-seqs", "8",
            "--num-kv-blocks", str(FAULT_SERVER_KV_BLOCKS), "--block-size", "16",
            "--log-level", "info"]
    with open(log_path, "w") as log, running_server(
            args, "tiny", env={FAULT_ENV: "nan_logits,row_error,grammar_error,detokenize_error"},
            log_file=log) as running:
        running.log_path = log_path
        yield running
