"""The pure parts of benchmarks/agentic.py and benchmarks/suffix_memory.py: aggregation and
ratios, the order of turns under concurrency, workload selection, llama-server's command line,
the figure, and the memory check's arithmetic. No server is started."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.agentic import run_rounds, run_workload
from benchmarks.agentic_plot import plot_agentic, target_labels
from benchmarks.agentic_run import (Target, TurnRecord, renumbered, run_concurrently,
                                    run_in_waves, run_interleaved, speculative_counts,
                                    summarize)
from benchmarks.agentic_servers import free_ports, llama_server_command
from benchmarks.agentic_workloads import (Turn, Workload, all_workloads,
                                          select_workloads)
from benchmarks.processes import descendants, resident_bytes, tree_rss_bytes
from benchmarks.suffix_memory import (checkpoints, distinct_prompt, suffix_cache_series,
                                      verdict)

OURS = [Target("none", "http://a", True), Target("ngram", "http://b", True),
        Target("suffix", "http://c", True)]
LLAMA = Target("llama-server-ngram-cache", "http://d", False)


def record(target: str, episode: int, turn: int, tokens: int, seconds: float, text: str = "x",
           draft: int | None = None, accepted: int | None = None) -> TurnRecord:
    return TurnRecord(target, episode, turn, tokens, seconds, draft, accepted, text)


def test_summarize_rates_ratios_and_acceptance():
    records = [record("none", 0, 0, 10, 1.0), record("none", 0, 1, 10, 1.0),
               record("ngram", 0, 0, 10, 0.5, draft=4, accepted=2),
               record("ngram", 0, 1, 10, 0.5, draft=6, accepted=3),
               record("suffix", 0, 0, 10, 0.25, draft=10, accepted=9),
               record("suffix", 0, 1, 10, 0.25, draft=10, accepted=9),
               record("llama-server-ngram-cache", 0, 0, 10, 0.4, text="other"),
               record("llama-server-ngram-cache", 0, 1, 10, 0.6, text="other")]
    result = summarize(records, OURS + [LLAMA])
    assert result["requests"] == 2
    assert result["none"]["tokens_per_s"] == 10.0
    assert result["suffix"]["tokens_per_s"] == 40.0
    assert result["ngram"]["acceptance_rate"] == 0.5
    assert result["suffix"]["acceptance_rate"] == 0.9
    assert result["none"]["acceptance_rate"] is None
    llama = result["llama-server-ngram-cache"]
    assert llama["draft_tokens"] is None and llama["acceptance_rate"] is None
    assert result["suffix_over_none"] == 4.0
    assert result["suffix_over_ngram"] == 2.0
    assert result["suffix_over_llama_server_ngram_cache"] == 2.0
    # llama-server's different text does not count against our lossless check
    assert result["outputs_identical_across_methods"] is True
    assert "wall_s" not in result["none"]


def test_summarize_flags_our_outputs_differing():
    records = [record("none", 0, 0, 5, 1.0, text="a"), record("suffix", 0, 0, 5, 1.0, text="b")]
    assert summarize(records, [OURS[0], OURS[2]])["outputs_identical_across_methods"] is False


def test_sampled_turns_compare_one_hot_drafters_only():
    """auto may draft from the EAGLE head, whose drafts are sampled: a seed keeps the law, not
    the tokens, so its sampled text may differ; suffix's may not, nor auto's greedy text."""
    auto = Target("auto", "http://e", True)

    def texts(auto_text, suffix_text, sampled):
        return [TurnRecord("none", 0, 0, 5, 1.0, None, None, "a", sampled),
                TurnRecord("suffix", 0, 0, 5, 1.0, 1, 1, suffix_text, sampled),
                TurnRecord("auto", 0, 0, 5, 1.0, 1, 1, auto_text, sampled)]

    def identical(records):
        return summarize(records, OURS[::2] + [auto])["outputs_identical_across_methods"]

    assert identical(texts("b", "a", sampled=True)) is True
    assert identical(texts("a", "b", sampled=True)) is False
    assert identical(texts("b", "a", sampled=False)) is False
    assert summarize(texts("a", "a", True), OURS[::2] + [auto])["auto_over_none"] == 1.0


def test_summarize_at_concurrency_divides_by_wall_time():
    records = [record("none", e, 0, 10, 2.0) for e in range(4)] + \
              [record("suffix", e, 0, 10, 1.0) for e in range(4)]
    result = summarize(records, [OURS[0], OURS[2]], {"none": 4.0, "suffix": 1.0})
    assert result["none"]["tokens_per_s"] == 10.0  # 40 tokens over 4 s of wall time, not 8 s
    assert result["none"]["wall_s"] == 4.0
    assert result["suffix_over_none"] == 4.0


def test_speculative_counts_from_either_server():
    ours = {"usage": {"speculative": {"draft_tokens": 8, "accepted_tokens": 5}}}
    llama = {"usage": {}, "timings": {"draft_n": 16, "draft_n_accepted": 7}}
    assert speculative_counts(ours) == (8, 5)
    assert speculative_counts(llama) == (16, 7)
    assert speculative_counts({"usage": {}, "timings": {"predicted_n": 3}}) == (0, 0)
    assert speculative_counts({"usage": {"completion_tokens": 3}}) == (None, None)


class FakeChat:
    """Answers every turn with a text naming the episode and turn, after `delay_s`; records the
    messages each call received and how many calls overlapped."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls, self.in_flight, self.max_in_flight = delay_s, [], 0, 0
        self.lock = threading.Lock()

    def __call__(self, target, system, messages, turn):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.calls.append((target.label, turn.user, [dict(m) for m in messages]))
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
        body = {"usage": {"completion_tokens": 3},
                "choices": [{"message": {"content": f"reply to {turn.user}"}}]}
        return body, self.delay_s


def agent_workload(num_episodes: int, num_turns: int) -> Workload:
    return Workload("loop", [[Turn(f"e{e}t{t}", history=t > 0) for t in range(num_turns)]
                             for e in range(num_episodes)], system="sys")


def test_concurrent_episodes_overlap_but_turns_stay_in_order():
    chat = FakeChat(delay_s=0.05)
    records, wall_s = run_concurrently(agent_workload(4, 3), OURS[2], chat, concurrency=4)
    assert chat.max_in_flight == 4
    assert len(records) == 12 and wall_s > 0
    for episode in range(4):
        users = [user for _, user, _ in chat.calls if user.startswith(f"e{episode}t")]
        assert users == [f"e{episode}t{t}" for t in range(3)]
        last = next(messages for _, user, messages in chat.calls if user == f"e{episode}t2")
        # the last turn re-sends the earlier turns and the replies the fake gave to them
        assert [m["content"] for m in last] == [f"e{episode}t0", f"reply to e{episode}t0",
                                                f"e{episode}t1", f"reply to e{episode}t1",
                                                f"e{episode}t2"]
    assert [(r.episode, r.turn) for r in records] == [(e, t) for e in range(4) for t in range(3)]


def test_concurrency_one_sends_one_request_at_a_time():
    chat = FakeChat(delay_s=0.01)
    run_concurrently(agent_workload(3, 2), OURS[2], chat, concurrency=1)
    assert chat.max_in_flight == 1


def test_batch_one_interleaves_and_rotates_who_goes_first():
    chat = FakeChat()
    records = run_interleaved(agent_workload(1, 3), OURS, chat)
    firsts = [chat.calls[i][0] for i in range(0, 9, 3)]
    assert firsts == ["none", "ngram", "suffix"]
    assert len(records) == 9


def test_concurrent_workloads_rotate_the_target_that_goes_first():
    orders = []
    for index in range(3):
        chat = FakeChat()
        _, wall_seconds = run_workload(agent_workload(2, 1), OURS, chat, concurrency=2,
                                       workload_index=index)
        orders.append(list(dict.fromkeys(label for label, _, _ in chat.calls)))
        assert wall_seconds["suffix"] >= 0
    assert [order[0] for order in orders] == ["none", "ngram", "suffix"]


def test_concurrent_waves_interleave_the_targets_and_sum_their_wall_times():
    chat = FakeChat(delay_s=0.02)
    records, wall_seconds = run_in_waves(agent_workload(5, 2), OURS, chat, concurrency=2)
    # three waves (episodes 0-1, 2-3, 4): every target runs a wave before the next starts,
    # and who goes first rotates
    waves = [[label for label, user, _ in chat.calls if user[1] in wave]
             for wave in ("01", "23", "4")]
    assert [list(dict.fromkeys(wave)) for wave in waves] == [
        ["none", "ngram", "suffix"], ["ngram", "suffix", "none"], ["suffix", "none", "ngram"]]
    assert chat.max_in_flight == 2
    assert len(records) == 3 * 10
    # each target's wall time is its three waves': two turns of 20 ms each
    assert all(0.11 < seconds < 0.5 for seconds in wall_seconds.values()), wall_seconds


def test_rounds_number_their_episodes_apart_and_sum_the_waves():
    chat = FakeChat()
    rounds = [[agent_workload(2, 1)], [agent_workload(3, 1)]]
    result = run_rounds(rounds, OURS, chat, concurrency=2)["loop"]
    assert result["episodes"] == 5 and result["requests"] == 5
    assert result["suffix"]["completion_tokens"] == 5 * 3
    # negative control: not renumbered, the second round's episodes 0-1 merge with the first's
    merged = [*run_in_waves(rounds[0][0], OURS, chat, 2)[0],
              *run_in_waves(rounds[1][0], OURS, chat, 2)[0]]
    assert summarize(merged, OURS)["requests"] == 3
    assert summarize([*merged[:6], *renumbered(merged[6:], 2)], OURS)["requests"] == 5


def test_workload_subset_and_repeats():
    full = all_workloads(seed=0, scale=1, repeats=12)
    assert [w.name for w in full] == ["agent_loop", "templated", "repeated_t0", "repeated_t0.7",
                                      "fresh_chat"]
    assert len(full[2].episodes) == 12 and len(full[3].episodes) == 12
    assert len(all_workloads(seed=0)[2].episodes) == 8
    chosen = select_workloads(full, ["templated", "repeated_t0"])
    assert [w.name for w in chosen] == ["templated", "repeated_t0"]
    assert chosen[0].episodes == full[1].episodes  # the same turns as in a full run
    assert select_workloads(full, None) == full
    with pytest.raises(ValueError, match="unknown workloads"):
        select_workloads(full, ["templated", "nope"])
    with pytest.raises(ValueError):
        all_workloads(seed=0, repeats=0)


def test_llama_server_command():
    command = llama_server_command("bin/llama-server", "m.gguf", 8080, 2, 1, ngram_cache=True)
    assert command == ["bin/llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port",
                       "8080", "-t", "2", "-tb", "2", "-np", "1", "-c", "8192", "--no-webui",
                       "--jinja", "--spec-type", "ngram-cache", "--spec-draft-n-max", "16"]
    plain = llama_server_command("bin/llama-server", "m.gguf", 8080, 2, 16, ngram_cache=False)
    assert "--spec-type" not in plain
    assert plain[plain.index("-np") + 1] == "16" and plain[plain.index("-c") + 1] == "32768"
    ports = free_ports(4)
    assert len(set(ports)) == 4


def synthetic_report() -> dict:
    def target(rate, acceptance):
        return {"tokens_per_s": rate, "acceptance_rate": acceptance}

    return {"benchmark": "agentic", "cpu": "test CPU", "concurrency": 1, "max_tokens": 8,
            "workloads": {
                "templated": {"none": target(10.0, None), "ngram": target(14.0, 0.4),
                              "suffix": target(20.0, 0.8), "suffix_over_none": 2.0,
                              "outputs_identical_across_methods": True},
                "fresh_chat": {"none": target(10.0, None), "ngram": target(9.0, 0.1),
                               "suffix": target(10.5, 0.2),
                               "llama-server-ngram-cache": target(8.0, None),
                               "suffix_over_none": 1.05}}}


def test_plot_writes_a_png(tmp_path):
    report = synthetic_report()
    assert target_labels(report) == ["none", "ngram", "suffix", "llama-server-ngram-cache"]
    path = tmp_path / "agentic.png"
    plot_agentic(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError):
        plot_agentic({"benchmark": "agentic"}, tmp_path / "none.png")


def test_memory_checkpoints_and_verdict():
    assert checkpoints(10000)[:3] == [100, 500, 1000] and checkpoints(10000)[-1] == 10000
    assert checkpoints(50) == [50]
    assert checkpoints(1234) == [100, 500, 1000, 1234]
    samples = [{"requests": 0, "rss_bytes": 500e6}, {"requests": 100, "rss_bytes": 700e6},
               {"requests": 500, "rss_bytes": 750e6}, {"requests": 1000, "rss_bytes": 790e6}]
    result = verdict(samples)
    assert result["growth_after_warmup_mb"] == 90.0 and result["passed"] is True
    assert result["growth_from_start_mb"] == 290.0 and result["passed_from_start"] is False
    samples[-1]["rss_bytes"] = 801e6
    assert verdict(samples)["passed"] is False
    short = verdict([{"requests": 0, "rss_bytes": 1e6}, {"requests": 50, "rss_bytes": 2e6}])
    assert short["passed"] is None and short["growth_from_start_mb"] == 1.0


def test_memory_process_tree_prompts_and_series():
    parents = {10: 1, 11: 10, 12: 11, 13: 1, 14: 10}
    assert sorted(descendants(10, parents)) == [10, 11, 12, 14]
    assert descendants(13, parents) == [13]
    import random

    rng = random.Random(0)
    prompts = [distinct_prompt(rng, i) for i in range(200)]
    assert len(set(prompts)) == 200
    assert len({len(p) for p in prompts}) > 50  # lengths vary
    exposition = ("# TYPE specserve:suffix_cache_nodes gauge\n"
                  'specserve:suffix_cache_nodes{model_name="m"} 42.0\n'
                  "# TYPE specserve:num_requests_running gauge\n"
                  'specserve:num_requests_running{model_name="m"} 1.0\n')
    assert suffix_cache_series(exposition) == {"specserve:suffix_cache_nodes": 42.0}


def test_resident_memory_is_read_with_its_parts():
    import os
    import subprocess
    import sys

    mine = resident_bytes(os.getpid())
    assert mine["rss"] > 0 and mine["rss"] == mine["anon"] + mine["file"] + mine["shmem"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = tree_rss_bytes(os.getpid())
        pids = [part["pid"] for part in tree["by_process"]]
        assert os.getpid() in pids and child.pid in pids
        assert tree["rss_bytes"] == sum(part["rss"] for part in tree["by_process"])
    finally:
        child.kill()
        child.wait()
    assert resident_bytes(child.pid)["rss"] == 0  # ended: nothing, no error
