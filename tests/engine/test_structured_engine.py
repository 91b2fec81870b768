"""Structured outputs in the engine: masks at every verified position, forced drafts, drafts cut
where the grammar refuses them; greedy output under a grammar equal to `none`'s for every
proposer, and the sampling law under a grammar unchanged by speculation (with a negative
control)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import SamplingParams
from engine.grammar import Constraint, GrammarMatcher
from engine.grammar.drafts import constrain_drafts
from engine.grammar.masks import allocate_bitmask, unpack_bitmask
from tests.conftest import make_llm
from tests.engine.test_spec_decode_engine import (  # noqa: F401 (a fixture)
    NUM_SAMPLES,
    PROMPT_IDS,
    VOCAB,
    _chi_square_rejects,
    method_options,
    small_vocab_models,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "colors"], "additionalProperties": False}
CONSTRAINTS = [Constraint.json_schema(SCHEMA), Constraint("json_object"),
               Constraint("regex", r"[0-9]{3}-[0-9]{4}( [a-z]+){0,4}"),
               Constraint.choice(["yes", "no", "maybe later"])]
PROMPTS = ["Describe a person as JSON:", "Write a JSON object about cats:", "Phone number:",
           "Should I go out today? Answer:"]


@pytest.fixture(scope="module")
def plain_structured():
    llm = make_llm(speculative_method="none")
    params = [SamplingParams(max_tokens=40, temperature=0, structured=c) for c in CONSTRAINTS]
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


def test_greedy_output_follows_the_grammar(plain_structured):
    tokens, llm = plain_structured
    texts = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    person = json.loads(texts[0])
    assert set(person) == {"name", "age", "colors"} and 0 <= person["age"] <= 120
    assert isinstance(json.loads(texts[1]), dict)
    import re
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}( [a-z]+){0,4}", texts[2])
    assert texts[3] in ("yes", "no", "maybe later")
    # Negative control: without the grammar the model writes something else.
    free = llm.generate(PROMPTS[3], SamplingParams(max_tokens=40, temperature=0))[0].text
    assert free not in ("yes", "no", "maybe later")


@pytest.mark.parametrize("method", ["ngram", "draft", "layer-skip", "eagle"])
def test_greedy_speculation_under_a_grammar_is_lossless(method, method_options,
                                                        plain_structured):
    expected, _ = plain_structured
    llm = make_llm(adaptive=False, num_speculative_tokens=4, **method_options[method])
    params = [SamplingParams(max_tokens=40, temperature=0, structured=c) for c in CONSTRAINTS]
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(PROMPTS, params)]
    assert alone == expected
    batched = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_forced_draft_tokens > 10  # keys and punctuation came as free drafts
    assert stats.num_forced_accepted_tokens > 0.8 * stats.num_forced_draft_tokens
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


# ------------------------------------------------------------------ the law under a grammar
# Over the tiny models' six tokens: x+ with x = 1 | 3 4 | 5 | 4 1, so after a 3 the grammar
# forces 4 and after a 4 that starts an x it forces 1 (forced drafts), and the n-gram drafts of
# PROMPT_IDS (3 1 2) are cut after their first token.
TOY_GRAMMAR = "start: x x x x+\nx: <[1]> | <[3]> <[4]> | <[5]> | <[4]> <[1]>"


def _toy_allowed(prefix) -> set[int]:
    """The grammar's next tokens, written out independently of the backend."""
    need = None
    for token in prefix:
        need = None if need is not None else {3: 4, 4: 1}.get(token)
    return {need} if need is not None else {1, 3, 4, 5}


def _masked_joint(hf_model, temperature: float) -> dict[tuple, float]:
    def next_probs(prefix):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT_IDS + list(prefix)])).logits[0, -1].float()
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[list(_toy_allowed(prefix))] = True
        return (logits / temperature).masked_fill(~allowed, float("-inf")).softmax(-1).tolist()

    joint = {}
    for t1, p1 in enumerate(next_probs(())):
        for t2, p2 in enumerate(next_probs((t1,)) if p1 else []):
            for t3, p3 in enumerate(next_probs((t1, t2)) if p2 else []):
                if p3:
                    joint[(t1, t2, t3)] = p1 * p2 * p3
    return joint


def _sample(llm, params) -> list[tuple]:
    seeded = [dataclasses.replace(params, seed=seed) for seed in range(NUM_SAMPLES)]
    return [tuple(o.token_ids[:3]) for o in llm.generate([PROMPT_IDS] * NUM_SAMPLES, seeded)]


def _fill_bonus_row_only(self, bitmask, row, draft_token_ids):
    """A deliberately wrong verifier: the grammar masks the bonus position only."""
    self._matcher.consume_tokens(list(draft_token_ids))
    self._fill(bitmask.numpy(), bitmask.data_ptr(), row + len(draft_token_ids))
    self._matcher.rollback(len(draft_token_ids))


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_sampling_under_a_grammar_keeps_the_masked_law(method, small_vocab_models, monkeypatch):
    target, draft, hf_target = small_vocab_models
    params = SamplingParams(max_tokens=4, temperature=1.0,
                            structured=Constraint("grammar", TOY_GRAMMAR))
    expected = _masked_joint(hf_target, 1.0)
    options = {"draft_model": str(draft)} if method == "draft" else {}
    llm = make_llm(str(target), speculative_method=method, adaptive=False,
                   num_speculative_tokens=3, max_num_seqs=512, max_num_batched_tokens=8192,
                   enable_prefix_caching=False, **options)
    samples = _sample(llm, params)
    assert all(t in expected for t in samples)  # every output follows the grammar
    assert not _chi_square_rejects(samples, expected)
    if method == "none":
        return
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_forced_draft_tokens > NUM_SAMPLES // 5  # steps that start after a 3
    assert 0 < stats.num_accepted_tokens - stats.num_forced_accepted_tokens
    monkeypatch.setattr(GrammarMatcher, "fill_masks", _fill_bonus_row_only)
    assert _chi_square_rejects(_sample(llm, params), expected)


def _wrong_known_tokens(requests, row_starts, bitmask):
    """A deliberately wrong skip: every constrained row taken as decided, by its lowest token."""
    rows = {}
    for request, start in zip(requests, row_starts):
        if request.grammar is not None:
            for row in range(start, start + len(request.draft_token_ids) + 1):
                allowed = unpack_bitmask(bitmask[row:row + 1], VOCAB, torch.device("cpu"))[0]
                rows[row] = int(allowed.nonzero()[0])
    return rows


def test_rows_the_grammar_decides_skip_the_lm_head_and_change_no_token(small_vocab_models,
                                                                        monkeypatch):
    """Seeded sampling under the toy grammar with `ngram`: the rows whose token the grammar
    forces get no LM head, and every token equals the run that computes every row. Negative
    control: taking rows with several allowed tokens as decided changes the tokens."""
    import engine.engine
    from engine.runner.model_runner import ModelRunner

    target, _, _ = small_vocab_models
    llm = make_llm(str(target), speculative_method="ngram", adaptive=False,
                   num_speculative_tokens=3, max_num_seqs=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, temperature=1.0,
                            structured=Constraint("grammar", TOY_GRAMMAR))
    seeded = [dataclasses.replace(params, seed=seed) for seed in range(64)]
    skipped = []
    execute = ModelRunner.execute

    def counting(self, model_input, known_tokens=None, *args):
        skipped.append(len(known_tokens or {}))
        return execute(self, model_input, known_tokens, *args)

    monkeypatch.setattr(ModelRunner, "execute", counting)
    with_skip = [o.token_ids for o in llm.generate([PROMPT_IDS] * 64, seeded)]
    assert sum(skipped) > 64  # forced 4s and 1s came without the LM head
    monkeypatch.setattr(engine.engine, "known_next_tokens", lambda *args: {})
    assert [o.token_ids for o in llm.generate([PROMPT_IDS] * 64, seeded)] == with_skip
    monkeypatch.setattr(engine.engine, "known_next_tokens", _wrong_known_tokens)
    assert [o.token_ids for o in llm.generate([PROMPT_IDS] * 64, seeded)] != with_skip


def test_logprobs_under_a_grammar_stay_the_raw_models(plain_structured, monkeypatch):
    """Masks go onto the logits in place only in steps where no row wants logprobs: a request
    that asks for them, batched with one that does not, gets the raw model's best alternatives,
    those of the same positions fed without a grammar. Control: masking in place regardless
    leaves only the grammar's tokens among them."""
    import engine.sample.sampler
    from engine.grammar import masks

    _, llm = plain_structured
    prompt = llm.tokenizer(PROMPTS[0])["input_ids"]
    asks = SamplingParams(max_tokens=5, temperature=0, structured=CONSTRAINTS[0], logprobs=3)
    quiet = dataclasses.replace(asks, logprobs=None)
    out = llm.generate([prompt, PROMPTS[1]], [asks, quiet])[0]
    for i, step in enumerate(out.logprobs):
        free = llm.generate([prompt + out.token_ids[:i]],
                            SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
        (top_ids, top_logprobs), (free_ids, free_logprobs) = (zip(*step.top),
                                                              zip(*free.logprobs[0].top))
        assert top_ids == free_ids and top_logprobs == pytest.approx(free_logprobs, abs=1e-4)
    monkeypatch.setattr(engine.sample.sampler, "mask_logits",
                        lambda logits, bitmask, in_place=False: masks.mask_logits(logits, bitmask,
                                                                                  True))
    masked = llm.generate([prompt, PROMPTS[1]], [asks, quiet])[0]
    assert masked.token_ids == out.token_ids
    assert [s.top for s in masked.logprobs] != [s.top for s in out.logprobs]


# ------------------------------------------------------------------ the pieces
@pytest.fixture(scope="module")
def toy_compiler(default_llm):
    from engine.grammar import GrammarCompiler

    return GrammarCompiler(default_llm.tokenizer, VOCAB, [2])


def test_masks_after_each_draft_and_state_unchanged(toy_compiler):
    matcher = toy_compiler.matcher(Constraint("grammar", TOY_GRAMMAR))
    bitmask = allocate_bitmask(4, matcher.num_mask_words)
    matcher.fill_masks(bitmask, 0, [3, 4, 5])
    allowed = unpack_bitmask(bitmask, VOCAB, torch.device("cpu"))
    for j, prefix in enumerate([(), (3,), (3, 4), (3, 4, 5)]):
        assert set(allowed[j].nonzero().flatten().tolist()) == _toy_allowed(prefix)
    assert matcher.forced_tokens() == []  # back at the start
    assert matcher.accept([3]) and matcher.forced_tokens() == [4]
    assert not matcher.accept([5])  # negative control: refused after 3


def test_drafts_are_cut_losslessly(toy_compiler):
    matcher = toy_compiler.matcher(Constraint("grammar", TOY_GRAMMAR))
    q = torch.rand(3, VOCAB)
    # One-hot drafts are cut before the first refused token ...
    assert constrain_drafts(matcher, [1, 3, 5], None, 4, False) == ([1, 3], None, 0)
    # ... sampled ones keep it, so that its rejection draws from max(0, p - q).
    drafts, probs, forced = constrain_drafts(matcher, [1, 3, 5], q, 4, False)
    assert drafts == [1, 3, 5] and torch.equal(probs, q) and forced == 0
    drafts, probs, _ = constrain_drafts(matcher, [1, 3, 5, 1], torch.rand(4, VOCAB), 4, False)
    assert drafts == [1, 3, 5] and probs.shape[0] == 3
    # Forced tokens replace the proposer's guess.
    matcher.accept([3])
    assert constrain_drafts(matcher, [5, 5], q[:2], 4, False) == ([4], None, 1)
