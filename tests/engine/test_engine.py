"""The whole engine on the embedded default model: equal to transformers (with float32
activations: EXACT_QUANTIZATION), batched or not, under preemption and chunked prefill; prefix
caching; blocks always come back; seeds reproduce."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.conftest import EXACT_QUANTIZATION, make_llm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def hf_reference(default_model_folder, default_llm):
    """transformers generate(), greedy, one prompt at a time: the ground truth."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32)
    eos = sorted(default_llm.engine.eos_token_ids)
    reference = []
    for prompt in PROMPTS:
        ids = default_llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos)
        reference.append(out[0, ids.shape[1]:].tolist())
    return reference


@pytest.fixture(scope="module")
def exact_llm():
    return make_llm(quantization=EXACT_QUANTIZATION)


def _assert_all_blocks_free(llm):
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(count == 0 for count in manager.ref_counts)


def test_greedy_matches_transformers_one_at_a_time(exact_llm, hf_reference):
    for prompt, expected in zip(PROMPTS, hf_reference):
        (out,) = exact_llm.generate(prompt, GREEDY)
        assert out.token_ids == expected, prompt
    _assert_all_blocks_free(exact_llm)


def test_greedy_matches_transformers_in_one_batch(exact_llm, hf_reference):
    outputs = exact_llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == hf_reference
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    _assert_all_blocks_free(exact_llm)


def test_preemption_keeps_outputs_identical(hf_reference):
    # 8 prompts of ~10 tokens + 24 new tokens each need ~16 blocks of 16 at once; give 10.
    llm = make_llm(num_kv_blocks=10, block_size=16, quantization=EXACT_QUANTIZATION)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == hf_reference
    _assert_all_blocks_free(llm)


def test_chunked_prefill_keeps_outputs_identical(hf_reference):
    llm = make_llm(max_num_batched_tokens=5, quantization=EXACT_QUANTIZATION)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == hf_reference


def test_chunked_prefill_keeps_the_integer_path_outputs_identical(default_llm):
    """auto on CPU multiplies int8 activations: row invariant, so five-token prefill chunks give
    the tokens of whole-prompt prefill there too."""
    whole = default_llm.generate(PROMPTS, GREEDY)
    chunked = make_llm(max_num_batched_tokens=5).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_prefix_cache_hits_for_shared_system_prompt(default_llm):
    system = ("You are a meticulous assistant for a shipping company. Answer in one short "
              "sentence, name the relevant department, and never invent tracking numbers. ") * 2
    questions = ["Where is my parcel?", "How do I change my address?", "Can I cancel an order?"]
    prompts = [
        default_llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    stats = default_llm.engine.block_manager.prefix_stats
    hits_before = stats.hits
    first = default_llm.generate(prompts[0], GREEDY)
    rest = default_llm.generate(prompts[1:], GREEDY)
    system_tokens = len(default_llm.tokenizer(system)["input_ids"])
    # Each later request reuses at least the full blocks of the shared system prompt.
    min_hit = (system_tokens // 16 - 1) * 16
    assert all(o.num_cached_tokens >= min_hit for o in rest)
    assert stats.hits - hits_before >= 2 * min_hit
    uncached = make_llm(enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in uncached]
    assert all(o.num_cached_tokens == 0 for o in uncached)
    _assert_all_blocks_free(default_llm)


def test_abort_frees_blocks_at_any_time(default_llm):
    engine = default_llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0)) for p in PROMPTS]
    engine.abort(ids[0])  # still waiting
    for _ in range(3):
        engine.step()
    for request_id in ids[1:]:  # running, mid-generation
        out = engine.abort(request_id)
        assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished()
    _assert_all_blocks_free(default_llm)


def test_seed_reproduces_alone_and_inside_a_batch(default_llm):
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = default_llm.generate(PROMPTS[2], seeded)
    noise = SamplingParams(max_tokens=20, temperature=1.0)
    batch = default_llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], [noise, seeded, noise])
    assert batch[1].token_ids == alone.token_ids
    (other_seed,) = default_llm.generate(PROMPTS[2], SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, seed=999))
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_tokens_and_logprobs(default_llm):
    (plain,) = default_llm.generate(PROMPTS[1], GREEDY)
    stop = plain.text[5:9]
    (stopped,) = default_llm.generate(PROMPTS[1], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == plain.text[: plain.text.index(stop)]
    (by_token,) = default_llm.generate(PROMPTS[1], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[plain.token_ids[3]]))
    assert by_token.token_ids == plain.token_ids[:4] and by_token.finish_reason == "stop"
    (with_logprobs,) = default_llm.generate(PROMPTS[1], SamplingParams(
        max_tokens=5, temperature=0, logprobs=3))
    assert len(with_logprobs.logprobs) == 5
    for entry in with_logprobs.logprobs:
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy = best
        assert entry.logprob == pytest.approx(entry.top[0][1])


def test_prompt_too_long_is_rejected_with_both_numbers(default_llm):
    limit = default_llm.engine.limits.max_model_len
    with pytest.raises(ValueError, match=rf"maximum context length is {limit}.*max_tokens is"):
        default_llm.generate("hi", SamplingParams(max_tokens=limit))


def test_a_request_that_ends_on_its_first_step_leaves_its_prompt_cached(default_llm):
    """max_tokens=1 finishes in the prefill step; its full blocks are cached before they are
    freed (they were not: the next identical prompt found nothing). The control: a prompt never
    seen before finds nothing."""
    prompt = "A prompt for the one-step prefix cache test, " * 4
    one = SamplingParams(max_tokens=1, temperature=0)
    [first] = default_llm.generate(prompt, one)
    [again] = default_llm.generate(prompt, one)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 16 * ((len(first.prompt_token_ids) - 1) // 16) > 0
    _assert_all_blocks_free(default_llm)
