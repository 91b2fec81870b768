"""Sliding-window attention through the whole engine (issue 25), on a tiny Mistral whose window
(12 tokens) is far shorter than its prompts and outputs: greedy output equal to transformers',
alone and batched, under chunked prefill, preemption and prefix caching; the blocks behind the
window given back as a request advances; every proposer lossless, drafts near the window edge
included. The layer-level logits (Mistral, Gemma 2 and 3) are in test_models.py."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.conftest import make_llm, make_random_head, make_tiny_model, transformers_greedy

WINDOW = 12
BLOCK_SIZE = 4
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
PROMPTS = [
    "one two three four five six seven eight nine ten eleven twelve one two three four five",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
]
TINY = dict(vocab_size=49152, eos_token_id=2, bos_token_id=1, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, default_model_folder):
    folder = tmp_path_factory.mktemp("mistral-window")
    hf_model = make_tiny_model(folder, "mistral", tokenizer_from=default_model_folder, **TINY)
    return folder, hf_model


@pytest.fixture(scope="module")
def reference(mistral):
    """transformers generate(), greedy, one prompt at a time."""
    folder, hf_model = mistral
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert all(len(tokenizer(p)["input_ids"]) > WINDOW for p in PROMPTS)  # cut by the window
    return transformers_greedy(hf_model, folder, PROMPTS, MAX_TOKENS)


def _all_blocks_free(llm) -> bool:
    manager = llm.engine.block_manager
    return manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)


def test_greedy_equals_transformers_alone_and_batched(mistral, reference):
    llm = make_llm(str(mistral[0]), speculative_method="none", block_size=BLOCK_SIZE)
    assert llm.engine.block_manager.window == WINDOW
    assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == reference
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert _all_blocks_free(llm)


def test_blocks_behind_the_window_are_given_back(mistral, reference):
    """A request holds at most the blocks its window can reach, plus the one being written;
    without release (the negative control) it holds every block of its context."""
    held = {}
    for window in (WINDOW, None):
        llm = make_llm(str(mistral[0]), speculative_method="none", block_size=BLOCK_SIZE)
        engine = llm.engine
        engine.block_manager.window = window
        engine.add_request(PROMPTS[0], GREEDY, request_id="long")
        most = 0
        while engine.has_unfinished():
            outputs = engine.step()
            (request,) = engine.scheduler.running or [None]
            if request is not None:
                in_use = sum(1 for count in engine.block_manager.ref_counts if count)
                assert in_use == len(request.block_table) - request.num_released_blocks
                most = max(most, in_use)
        assert outputs[-1].token_ids == reference[0]
        assert _all_blocks_free(llm)
        held[window] = most
    context = len(llm.tokenizer(PROMPTS[0])["input_ids"]) + MAX_TOKENS
    assert held[None] >= context // BLOCK_SIZE
    assert held[WINDOW] <= WINDOW // BLOCK_SIZE + 2


def test_chunked_prefill_and_preemption_keep_the_output(mistral, reference):
    chunked = make_llm(str(mistral[0]), speculative_method="none", block_size=BLOCK_SIZE,
                       max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == reference
    # A request holds ~5 blocks of 4 within its window (~12 without release): 12 blocks hold
    # all of one (they could not without release). Prefilled in chunks of 8, the three are
    # admitted side by side and then preempt one another.
    tight = make_llm(str(mistral[0]), speculative_method="none", block_size=BLOCK_SIZE,
                     num_kv_blocks=12, max_num_batched_tokens=8)
    outputs = tight.generate(PROMPTS, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference
    assert _all_blocks_free(tight)


def test_prefix_cache_hits_across_the_window_edge(mistral, reference):
    llm = make_llm(str(mistral[0]), speculative_method="none", block_size=BLOCK_SIZE)
    first = llm.generate(PROMPTS[1], GREEDY)[0]
    again = llm.generate(PROMPTS[1], GREEDY)[0]
    assert again.num_cached_tokens > WINDOW  # blocks released behind the window, then reused
    assert first.token_ids == again.token_ids == reference[1]
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft", "eagle"])
def test_every_proposer_is_lossless_past_the_window(mistral, reference, method,
                                                    tmp_path_factory, default_model_folder):
    options = {"ngram": {}, "layer-skip": {"draft_layer_ids": (0, 2)}, "draft": {},
               "eagle": {}}[method]
    if method == "eagle":  # an untrained head, attending to everything: its KV is kept whole
        options["draft_head"] = make_random_head(mistral[0], tmp_path_factory.mktemp("h"), 8192)
    if method == "draft":  # a draft with full attention: its KV is kept whole
        draft = tmp_path_factory.mktemp("mistral-draft")
        make_tiny_model(draft, "mistral", tokenizer_from=default_model_folder,
                        num_hidden_layers=2, **{**TINY, "sliding_window": None})
        options["draft_model"] = str(draft)
    llm = make_llm(str(mistral[0]), speculative_method=method, adaptive=False,
                   num_speculative_tokens=4, block_size=BLOCK_SIZE, **options)
    assert llm.engine.block_manager.window == (None if method in ("draft", "eagle") else WINDOW)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.spec_stats.num_draft_tokens for o in outputs) > 0
    assert _all_blocks_free(llm)
