"""The command line: every flag documented, mapped onto the engine and server settings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import build_parser, engine_config_from_args

FLAGS = ["--host", "--port", "--model", "--served-model-name", "--dtype", "--speculative-method",
         "--num-speculative-tokens", "--draft-model", "--draft-head", "--eagle-ngram-min",
         "--draft-layers", "--max-model-len",
         "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory", "--num-kv-blocks",
         "--max-queue", "--metrics-prefix", "--api-key", "--log-level", "--response-store",
         "--response-store-max-mb", "--suffix-max-depth",
         "--suffix-max-spec-factor", "--suffix-min-token-prob", "--suffix-cache-max-requests",
         "--suffix-cache-max-bytes", "--suffix-cache-scope", "--suffix-cache-prompts"]


def test_help_documents_every_flag():
    result = subprocess.run([sys.executable, "-m", "server", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for flag in FLAGS:
        assert flag in result.stdout, flag


def test_flags_map_onto_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--speculative-method", "layer-skip", "--num-speculative-tokens", "3",
        "--draft-layers", "6", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--num-kv-blocks", "100", "--max-queue", "7", "--api-key", "k",
    ])
    config = engine_config_from_args(args)
    assert config.speculative.speculative_method == "layer-skip"
    assert config.speculative.num_speculative_tokens == 3
    assert config.speculative.draft_layers == 6
    assert config.model.max_model_len == 1024 and config.scheduler.max_num_seqs == 8
    assert config.cache.num_kv_blocks == 100
    assert args.max_queue == 7 and args.api_key == "k"


def test_suffix_flags_map_onto_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--speculative-method", "suffix", "--suffix-max-depth", "16",
        "--suffix-cache-max-requests", "50", "--suffix-cache-scope", "global",
        "--suffix-min-token-prob", "0.3", "--suffix-cache-prompts"])
    spec = engine_config_from_args(args).speculative
    assert (spec.speculative_method, spec.suffix_max_depth, spec.suffix_cache_max_requests,
            spec.suffix_cache_scope, spec.suffix_min_token_prob, spec.suffix_cache_prompts) == \
        ("suffix", 16, 50, "global", 0.3, True)
    defaults = engine_config_from_args(build_parser().parse_args(["serve"])).speculative
    assert (defaults.suffix_cache_scope, defaults.suffix_cache_prompts) == ("tenant", False)
    for flags, message in ((["--suffix-max-depth", "1"], "--suffix-max-depth must be in"),
                           (["--suffix-min-token-prob", "2"], "--suffix-min-token-prob must be"),
                           (["--suffix-cache-max-bytes", "-1"], "--suffix-cache-max-bytes must"),
                           (["--suffix-max-spec-factor", "inf"], "must be finite and > 0")):
        with pytest.raises(ValueError, match=message):
            engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_draft_at_prefill_is_auto_unless_a_flag_says():
    """None lets the engine decide where it is lossless (prefill_drafts.py); either flag is
    carried as said, so that asking for it where it cannot be is refused at start."""
    def parsed(*flags):
        args = build_parser().parse_args(["serve", *flags])
        return engine_config_from_args(args).speculative.draft_at_prefill
    assert (parsed(), parsed("--draft-at-prefill"), parsed("--no-draft-at-prefill")) == \
        (None, True, False)


def test_defaults_serve_the_default_model_with_ngram_speculation(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    config = engine_config_from_args(args)
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert config.model.model is None
    assert config.speculative.speculative_method == "ngram"  # measured ahead of eagle on CPU
    assert config.speculative.num_speculative_tokens == 5


def test_train_draft_documents_its_flags():
    result = subprocess.run([sys.executable, "-m", "specserve", "train-draft", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for flag in ("--model", "--output", "--device", "--max-minutes", "--max-prompts",
                 "--architecture"):
        assert flag in result.stdout, flag


def test_bad_flag_values_fail_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "server", "--speculative-method", "draft"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "specserve: error: --speculative-method draft needs --draft-model PATH")


def test_every_quantization_name_reaches_the_engine_and_others_are_refused():
    """`gguf-exact` (float32 activations on GGUF blocks) is a name that checks outside the
    project use: the flag and the offline API both take it."""
    from engine import EngineConfig

    for name in ("auto", "gguf-exact", "gguf", "none"):
        args = build_parser().parse_args(["serve", "--quantization", name])
        assert engine_config_from_args(args).model.quantization == name
        assert EngineConfig.from_kwargs(quantization=name).model.quantization == name
    result = subprocess.run([sys.executable, "-m", "server", "serve", "--quantization", "gguf-x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "gguf-exact" in result.stderr
