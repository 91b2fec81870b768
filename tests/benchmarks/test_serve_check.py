"""benchmarks/serve_check.py's pure parts (device_check.sh serve70 runs the whole on a GPU; a
dry run on a CPU: `--server-args "--model DIR --device cpu" --scale 0.05`)."""

from __future__ import annotations

from transformers import AutoTokenizer

from benchmarks import serve_check


def test_counts_scale_down_for_dry_runs_and_keep_the_issues_at_one():
    assert serve_check.counts(1.0) == {"first_requests": 100, "ttft_prompts": 8,
                                       "concurrency": 64, "concurrent_requests": 256,
                                       "concurrent_tokens": 256}
    assert min(serve_check.counts(0.001).values()) == 2


def test_filler_prompts_fit_their_length_and_never_repeat(default_model_folder):
    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    def num_tokens(text: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    template = num_tokens("x")  # the template's own tokens (a default system turn): the floor
    texts = set()
    for length in serve_check.PROMPT_TOKENS:
        text = serve_check.filler_prompt(tokenizer, length, seed=length)
        if length > 2 * template:
            assert 0.6 * length <= num_tokens(text) <= length
        else:
            assert num_tokens(text) <= template + 8
        texts.add(text)
    assert len(texts) == len(serve_check.PROMPT_TOKENS)


def test_verdicts_hold_the_run_to_the_issues_targets():
    brief = {"output_tokens_per_s": 30_000, "ttft_p50_ms": 12, "ttft_p99_ms": 20}
    report = {"ttft_batch1_by_prompt_tokens": {"16": brief, "512": {**brief, "ttft_p50_ms": 16}},
              "first_requests_after_ready": {"ttft_p99_ratio": 1.5},
              "concurrent": {"steady": brief},
              "after_ready_counters": {"graph_captures_after_ready_total": 0.0,
                                       "shape_first_use_after_ready_total": 1.0},
              "cold_start_to_ready_s": 40, "warm_start_to_ready_s": 16,
              "agentic_batch1": {"agent_loop": {"none_over_offline": 0.9,
                                                "suffix_over_none": 1.2}}}
    assert serve_check.verdicts(report) == {
        "ttft_p50_le_15ms_to_512_tokens": False, "first_requests_ttft_p99_le_2x_steady": True,
        "concurrent_ge_25000_tok_s": True, "concurrent_ttft_p50_le_50ms": True,
        "no_first_use_after_ready": False, "cold_start_le_45s": True,
        "warm_start_le_15s": False, "agent_loop_server_ge_0.8x_offline": True,
        "agent_loop_suffix_ge_1.5x_none": False}
