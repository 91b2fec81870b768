"""`--speculative-config`: vLLM's JSON maps onto our flags; a key we do not support, or a separate
flag that says otherwise, is an error that names it; a server given a head that does not fit
exits with the message; a server given a published EAGLE-3 head this way serves `none`'s greedy
output."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from server.cli import build_parser, engine_config_from_args


def _config(spec: dict, *flags: str):
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(spec), *flags])
    return engine_config_from_args(args).speculative


def test_help_documents_the_flag():
    result = subprocess.run([sys.executable, "-m", "server", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert "--speculative-config" in result.stdout and "eagle3" in result.stdout


def test_eagle3_maps_onto_eagle_with_the_head(tmp_path):
    spec = _config({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert (spec.speculative_method, spec.draft_head, spec.num_speculative_tokens) == \
        ("eagle", str(tmp_path), 3)


def test_ngram_maps_its_lookup_lengths():
    spec = _config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
                    "prompt_lookup_min": 2})
    assert (spec.speculative_method, spec.num_speculative_tokens, spec.ngram_max,
            spec.ngram_min) == ("ngram", 4, 5, 2)


def test_suffix_maps_its_settings():
    spec = _config({"method": "suffix", "suffix_decoding_max_tree_depth": 32,
                    "suffix_decoding_max_cached_requests": 7,
                    "suffix_decoding_max_spec_factor": 2.0,
                    "suffix_decoding_min_token_prob": 0.2})
    assert (spec.speculative_method, spec.suffix_max_depth, spec.suffix_cache_max_requests,
            spec.suffix_max_spec_factor, spec.suffix_min_token_prob) == ("suffix", 32, 7, 2.0, 0.2)


def test_draft_model_maps_onto_draft(tmp_path):
    spec = _config({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2,
                    "draft_tensor_parallel_size": 1})
    assert (spec.speculative_method, spec.draft_model) == ("draft", str(tmp_path))


def test_without_a_method_a_published_head_folder_is_eagle3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert _config({"model": str(tmp_path)}).speculative_method == "eagle"


def test_a_flag_that_agrees_is_fine():
    spec = _config({"method": "ngram", "num_speculative_tokens": 3},
                   "--num-speculative-tokens", "3", "--speculative-method", "ngram")
    assert spec.num_speculative_tokens == 3


@pytest.mark.parametrize(("spec", "flags", "message"), [
    ({"method": "ngram", "foo": 1}, (), "key 'foo' is not supported"),
    ({"method": "ngram", "speculative_token_tree": "[(0,)]"}, (),
     "key 'speculative_token_tree' is not supported"),
    ({"method": "medusa", "model": "x"}, (), "method 'medusa' is not supported"),
    ({"method": "eagle3", "model": "x", "draft_tensor_parallel_size": 2}, (),
     "draft_tensor_parallel_size 2 is not supported"),
    ({"method": "ngram", "draft_sample_method": "greedy"}, (),
     "draft_sample_method 'greedy' is not supported"),
    ({"method": "ngram", "model": "x"}, (), "method 'ngram' takes no model"),
    ({"method": "ngram"}, ("--speculative-method", "suffix"),
     "sets speculative_method to 'ngram' but --speculative-method says 'suffix'"),
    ({"method": "ngram", "num_speculative_tokens": 3}, ("--num-speculative-tokens", "5"),
     "--num-speculative-tokens says 5"),
    ({"method": "eagle3", "model": "/a"}, ("--draft-head", "/b"), "--draft-head says '/b'"),
    ({}, (), "needs a method"),
])
def test_bad_speculative_configs_are_refused_by_name(spec, flags, message):
    with pytest.raises(ValueError, match=message):
        _config(spec, *flags)


def test_text_that_is_not_json_is_refused():
    args = build_parser().parse_args(["serve", "--speculative-config", "{method: ngram}"])
    with pytest.raises(ValueError, match="is not JSON"):
        engine_config_from_args(args)


def test_the_server_exits_with_the_message_on_an_unknown_key():
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--speculative-config",
         '{"method": "eagle3", "model": "h", "num_lookahead_slots": 2}'],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "key 'num_lookahead_slots' is not supported" in result.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def tiny4_with_head(tmp_path_factory, default_model_folder):
    from tests.conftest import make_tiny_model
    from tests.engine.spec_decode.published_heads import write_head

    folder = tmp_path_factory.mktemp("tiny4-server")
    hf = make_tiny_model(folder / "model", vocab_size=49152, num_hidden_layers=4,
                         eos_token_id=2, bos_token_id=1, tokenizer_from=default_model_folder)
    good = write_head(folder / "head", hf.config, list(range(0, 49152, 7)), [1, 2, 3])
    bad = write_head(folder / "bad", hf.config, list(range(0, 49152, 7)), [1, 2, 3],
                     config_overrides={"target_hidden_size": 4096})
    return folder / "model", good, bad


def test_a_server_exits_with_the_message_when_the_head_does_not_fit(tiny4_with_head):
    from tests.servers import engine_test_args

    model, _, bad = tiny4_with_head
    spec = json.dumps({"method": "eagle3", "model": str(bad), "num_speculative_tokens": 3})
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--port", "1", *engine_test_args([]),
         "--model", str(model), "--speculative-config", spec],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "the target's hidden size is 64" in result.stderr


def test_a_server_with_a_published_head_serves_nones_greedy_output(tiny4_with_head):
    from tests.conftest import make_llm
    from tests.servers import running_server

    from engine import SamplingParams

    model, good, _ = tiny4_with_head
    prompt = "The capital of France is"
    expected = make_llm(str(model), speculative_method="none").generate(
        prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    spec = json.dumps({"method": "eagle3", "model": str(good), "num_speculative_tokens": 3})
    with running_server(["--model", str(model), "--served-model-name", "tiny4",
                         "--speculative-config", spec], "tiny4") as server:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": "tiny4", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
