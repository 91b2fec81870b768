"""A server with --tensor-parallel-size 2 whose rank 1 is killed (issue 73): the stream in flight
ends with an `engine_dead` error within 10 s and the server exits non-zero; a rank killed while
the server idles ends it too, with the engine in the server's process or its own. Nothing waits
on a collective whose peer is gone."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.conftest import make_tiny_model
from tests.server.stream_kill import kill_under_a_stream
from tests.servers import running_server

PID_LINE = re.compile(r"followers' pids \[(\d+)\]")


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, default_model_folder):
    """A tiny Llama with room for a stream of a few thousand tokens (seconds of them)."""
    folder = tmp_path_factory.mktemp("tp-tiny")
    make_tiny_model(folder, vocab_size=49152, max_position_embeddings=8192,
                    tokenizer_from=default_model_folder, eos_token_id=2, bos_token_id=1)
    return folder


def _serve(model, log, engine_core: str = "thread"):
    return running_server(["--model", str(model), "--tensor-parallel-size", "2",
                           "--engine-core", engine_core, "--speculative-method", "none",
                           "--log-level", "info"], model.name, log_file=log)


def _rank1_pid(log_path) -> int:
    return int(PID_LINE.search(log_path.read_text()).group(1))


def test_killed_rank_fails_the_stream_and_ends_the_server(tmp_path, long_context_model):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log, _serve(long_context_model, log) as server:
        rank1 = _rank1_pid(log_path)
        killed_at = kill_under_a_stream(server, "one two three", 8000, rank1, 20, "rank 1")
        assert server.process.wait(timeout=10) != 0
        assert time.monotonic() - killed_at < 10
    assert "tensor-parallel rank 1" in log_path.read_text()


# In the engine's own process (--engine-core process, the GPU default) rank 0 is that process:
# its step loop checks the followers between polls for commands.
@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_rank_killed_while_idle_ends_the_server(tmp_path, long_context_model, engine_core):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log, _serve(long_context_model, log, engine_core) as server:
        os.kill(_rank1_pid(log_path), signal.SIGKILL)
        killed_at = time.monotonic()
        assert server.process.wait(timeout=10) != 0
        assert time.monotonic() - killed_at < 10
    assert "tensor-parallel rank 1 exited with status -9" in log_path.read_text()
