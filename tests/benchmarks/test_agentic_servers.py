"""benchmarks/agentic_servers.py: on a GPU our servers split the card between them (each asked for
0.9 of it, so the second refused to start, issue 70); each server's start and its untimed first
request are measured apart from the benchmark."""

from __future__ import annotations

import pytest

from benchmarks import agentic_servers
from benchmarks.agentic_servers import (gpu_share_args, serves_on_gpu, start_all,
                                        warm_up_targets)


def test_servers_on_a_gpu_share_the_card_between_them():
    assert gpu_share_args([], 4, on_gpu=True) == ["--gpu-memory-utilization", "0.225"]
    assert gpu_share_args(["--max-num-seqs", "8"], 2, on_gpu=True) == [
        "--gpu-memory-utilization", "0.450"]
    # nothing to split: one server, a CPU, or memory the user sized
    assert gpu_share_args([], 1, on_gpu=True) == []
    assert gpu_share_args([], 4, on_gpu=False) == []
    assert gpu_share_args(["--gpu-memory-utilization", "0.2"], 4, on_gpu=True) == []
    assert gpu_share_args(["--kv-cache-memory", "2"], 4, on_gpu=True) == []


def test_the_device_flag_decides_where_the_servers_run():
    assert serves_on_gpu(["--device", "cuda:1"]) is True
    assert serves_on_gpu(["--device", "cpu"]) is False


@pytest.mark.parametrize("on_gpu", [False, True])
def test_started_servers_carry_their_share_and_report_their_start(tiny_chat_model_folder,
                                                                  tmp_path, monkeypatch,
                                                                  on_gpu):
    """Real servers (on the CPU, which takes the GPU flag and sizes nothing by it)."""
    monkeypatch.setattr(agentic_servers, "serves_on_gpu", lambda args: on_gpu)
    args = ["--model", str(tiny_chat_model_folder), "--device", "cpu", "--dtype", "float32",
            "--max-num-seqs", "2"]
    servers = start_all(["none", "ngram"], args, tmp_path, None, False, 1, 1)
    try:
        shares = [command.split("--gpu-memory-utilization ")[1].split()[0]
                  for command in servers.commands.values() if "--gpu-memory" in command]
        assert shares == (["0.450", "0.450"] if on_gpu else [])
        assert set(servers.start_seconds) == {"none", "ngram"}
        assert all(seconds > 0 for seconds in servers.start_seconds.values())
        warmups = warm_up_targets(servers.targets, 4)
        assert set(warmups) == {"none", "ngram"} and all(s > 0 for s in warmups.values())
    finally:
        servers.stop()


def test_the_agent_loop_through_the_server_against_the_engine_offline(tiny_chat_model_folder,
                                                                       tmp_path):
    """`--offline none`: the same turns answered by the server and by an LLM in this process
    (the servers' model, dtype and device); the report holds the server's tokens/s over the
    engine's."""
    import json

    from benchmarks import agentic

    model = str(tiny_chat_model_folder)
    output = tmp_path / "agentic.json"
    agentic.main(["--methods", "none", "--offline", "none", "--workloads", "agent_loop",
                  "--max-tokens", "8", "--server-args", f"--model {model} --device cpu "
                  "--dtype float32", "--log-dir", str(tmp_path), "--output", str(output)])
    report = json.loads(output.read_text())
    loop = report["workloads"]["agent_loop"]
    assert loop["none"]["completion_tokens"] == loop["offline-none"]["completion_tokens"] > 0
    assert loop["none_over_offline"] == pytest.approx(
        loop["none"]["tokens_per_s"] / loop["offline-none"]["tokens_per_s"], abs=0.01)
    assert set(report["warmup_seconds"]) == {"none"}
    assert set(report["server_start_seconds"]) == {"none"}


def test_offline_engines_take_the_servers_model_and_their_share_of_the_card(monkeypatch):
    from benchmarks import agentic

    args = ["--model", "m", "--dtype", "bfloat16", "--max-model-len", "512", "--port", "1"]
    monkeypatch.setattr(agentic, "serves_on_gpu", lambda args: True)
    assert agentic.offline_engine_options(args, 4) == {
        "model": "m", "dtype": "bfloat16", "max_model_len": 512, "gpu_memory_utilization": 0.225}
    monkeypatch.setattr(agentic, "serves_on_gpu", lambda args: False)
    assert "gpu_memory_utilization" not in agentic.offline_engine_options(args, 4)
