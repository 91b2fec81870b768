"""`specserve bench serve --duration ... --disconnect-fraction ...` (the soak run) against a real
server on a tiny model: arrivals stop at the duration, planned hang-ups are counted apart from
failures, the server's RSS / KV usage are sampled and, once it is idle, no request or KV block is
left behind by the clients that left; hostile structured-output bodies mixed in
(`--hostile-rate`) are each refused with a 400 while the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.servers import running_server


def _soak(model_folder, method: str, output, *bench_args: str) -> dict[str, float]:
    """`bench serve` with `bench_args` into `output` against a fresh server on the tiny model;
    returns the server's metrics once it is idle after the run."""
    args = ["--model", str(model_folder), "--served-model-name", "tiny",
            "--speculative-method", method]
    with running_server(args, "tiny") as server:
        result = subprocess.run(
            [sys.executable, "-m", "specserve", "bench", "serve", "--base-url", server.base_url,
             *bench_args, "--no-progress", "--output", str(output)],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return server.wait_until_idle(timeout=30)


def test_timed_run_with_clients_that_hang_up(tiny_chat_model_folder, tmp_path):
    # The tiny model's context is 512 tokens, the longest chat prompt 402: 100 new tokens fit.
    output = tmp_path / "soak.json"
    idle = _soak(tiny_chat_model_folder, "none", output,
                 "--workload", "chat", "--max-tokens", "100", "--ignore-eos", "--concurrency", "64",
                 "--request-rate", "8", "--duration", "4", "--disconnect-fraction", "0.5",
                 "--disconnect-within", "0.2", "--hostile-rate", "2")
    (run,) = json.loads(output.read_text())["runs"]
    (r,) = run["results"]
    sent = r["num_requests"] + r["client_disconnects"]
    assert 10 <= sent <= 80  # ~8/s for 4 s, then no more
    assert r["failed"] == 0, r["errors"]
    assert r["completed"] == r["num_requests"] >= 1
    assert r["client_disconnects"] >= 1  # 100 tokens take longer than the shortest delays
    assert r["total_output_tokens"] == 100 * r["completed"]
    # Hostile bodies beside it, two a second: each a quick 400, and the run undisturbed above.
    hostile = r["hostile"]
    assert hostile["sent"] >= 4 and hostile["statuses"] == {"400": hostile["sent"]}, hostile
    assert hostile["max_seconds"] < 5, hostile
    state = r["server_state"]
    assert state["before"]["rss_bytes"] > 0 and state["after_idle"]["idle"] is True
    assert state["after_idle"]["kv_cache_usage_perc"] == 0
    assert idle["kv_cache_free_blocks"] == idle["kv_cache_num_blocks"]


def test_mixed_traffic_is_checked_and_the_event_loop_lag_reported(tiny_chat_model_folder,
                                                                   tmp_path):
    """The soak's own traffic (`--workload mixed`: completions and chat, structured outputs and
    tools, streamed and whole): every answer is checked against what it asked for, and the
    server's event-loop lag is sampled with its memory."""
    output = tmp_path / "mixed.json"
    _soak(tiny_chat_model_folder, "ngram", output,
          "--workload", "mixed", "--max-tokens", "48", "--concurrency", "4", "--duration", "6",
          "--disconnect-fraction", "0.2")
    (run,) = json.loads(output.read_text())["runs"]
    (r,) = run["results"]
    assert r["failed"] == 0, r["errors"]  # no answer broke its request, no 5xx
    assert r["completed"] >= 8  # at least one of each of the eight shapes
    state = r["server_state"]
    assert state["before"]["loop_lags_over_50ms"] >= 0
    assert 0 < state["after_idle"]["loop_lag_max_le_s"] <= 5
    rows = r["timeline"]  # one-second windows over the run, as the figure draws them
    assert sum(row["completed"] for row in rows) == r["completed"]
    assert sum(row["client_disconnects"] for row in rows) == r["client_disconnects"]
    assert output.with_suffix(".png").stat().st_size > 10_000
