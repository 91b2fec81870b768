"""Drafts at prefill (engine/spec_decode/prefill_drafts.py): a prompt's last chunk verifies the
proposer's guesses at the answer, so its first step emits several tokens; the output stays
exactly `none`'s, greedy and seeded, whole or chunked; and where it cannot be lossless it is
refused when asked for and off by default."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.prefill_drafts import drafts_at_prefill
from tests.conftest import make_llm
from tests.engine.test_scheduler import make_request, make_scheduler

# A prompt whose answer repeats it: the n-gram lookup finds the continuation in the prompt.
REPEATING = ("Repeat after me: the cat sat on the mat and the dog sat on the log. "
             "Repeat after me: the cat sat on the mat and the dog sat on the log. "
             "Repeat after me: the cat sat on the mat and the dog")
PROMPTS = [REPEATING, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
           "The capital of France is"]
GREEDY = SamplingParams(max_tokens=32, temperature=0)
SEEDED = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)


def first_step_tokens(llm, prompt: str, params: SamplingParams) -> list[int]:
    """The tokens the request's first engine step emits (its prompt's step)."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    outputs = [o for o in engine.step() if o.request_id == request_id]
    while engine.has_unfinished():
        engine.step()
    return list(outputs[0].delta_token_ids) if outputs else []


@pytest.fixture(scope="module")
def plain():
    llm = make_llm(speculative_method="none")
    return {"greedy": [o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
            "seeded": [o.token_ids for o in llm.generate(PROMPTS, SEEDED)],
            "first": first_step_tokens(llm, REPEATING, GREEDY)}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_prompts_step_emits_accepted_drafts_and_the_output_is_nones(method, plain):
    llm = make_llm(speculative_method=method, num_speculative_tokens=8, adaptive=False)
    assert llm.engine.scheduler.draft_at_prefill  # on by default on CPU float32
    first = first_step_tokens(llm, REPEATING, GREEDY)
    assert len(first) >= 2, "the prompt's step verified no draft"
    assert first == plain["greedy"][0][:len(first)]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain["greedy"]
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == plain["seeded"]
    # one at a time too: a batch's other prompts must not matter
    assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == plain["greedy"]
    if method == "suffix":  # its global cache holds the answers now: the prompt's step drafts
        again = first_step_tokens(llm, PROMPTS[2], GREEDY)  # long chains, accepted
        assert len(again) > 4 and again == plain["greedy"][2][:len(again)]


def test_off_the_prompts_step_emits_one_token(plain):
    """Negative control: the same engine with drafts at prefill off yields one token from the
    prompt's step, as `none` does."""
    assert len(plain["first"]) == 1
    llm = make_llm(speculative_method="ngram", num_speculative_tokens=8, adaptive=False,
                   draft_at_prefill=False)
    assert not llm.engine.scheduler.draft_at_prefill
    assert first_step_tokens(llm, REPEATING, GREEDY) == plain["first"]


def test_a_chunked_prompt_drafts_only_after_its_last_chunk(plain):
    llm = make_llm(speculative_method="ngram", num_speculative_tokens=8, adaptive=False,
                   max_num_batched_tokens=16)
    engine = llm.engine
    request_id = engine.add_request(REPEATING, GREEDY)
    steps = []
    while engine.has_unfinished():
        outputs = [o for o in engine.step() if o.request_id == request_id]
        steps.append(list(outputs[0].delta_token_ids) if outputs else [])
    emitted = [tokens for tokens in steps if tokens]
    assert len(steps) - len(emitted) >= 3  # chunks before the last emit nothing
    assert len(emitted[0]) > 2  # the last chunk carried drafts, accepted
    assert [t for tokens in emitted for t in tokens] == plain["greedy"][0]
    assert llm.generate(PROMPTS, SEEDED)[0].token_ids == plain["seeded"][0]


def test_scheduler_reserves_draft_slots_only_after_a_prompts_last_chunk():
    scheduler = make_scheduler(budget=32)
    scheduler.draft_at_prefill = True
    long_prompt, short_prompt = make_request("long", 40), make_request("short", 6, first=100)
    grammar = make_request("grammar", 6, first=200)
    grammar.grammar = object()  # any grammar: its drafts start with its first decode step
    for request in (long_prompt, short_prompt, grammar):
        scheduler.add(request)
    out = scheduler.schedule(lambda request: 4)
    lookahead = {s.request.request_id: (s.num_new_tokens, s.num_lookahead) for s in out.scheduled}
    assert lookahead == {"long": (32, 0)}  # a first chunk: no drafts after it
    scheduler.update_from_output(out, [[]])
    out = scheduler.schedule(lambda request: 4)
    lookahead = {s.request.request_id: (s.num_new_tokens, s.num_lookahead) for s in out.scheduled}
    # the last chunk and a whole short prompt get slots, within the budget; a grammar's none
    assert lookahead == {"long": (8, 4), "short": (6, 4), "grammar": (6, 0)}
    assert out.num_batched_tokens == 8 + 6 + 6  # no drafts set yet
    assert len(long_prompt.block_table) * 4 >= 40 + 4  # the slots are held
    # negative control: the flag off reserves none at prefill
    off = make_scheduler(budget=32)
    off.add(make_request("short", 6, first=100))
    assert [s.num_lookahead for s in off.schedule(lambda request: 4).scheduled] == [0]


def test_a_prompt_the_prefix_cache_holds_but_its_last_token_gets_draft_slots():
    """Admitted with one token left to feed (a repeated prompt), a request gets slots as a
    decoding one does; without drafts at prefill an admitted request never had them."""
    for flag, expected in ((True, 4), (False, 0)):
        scheduler = make_scheduler(budget=32)
        scheduler.draft_at_prefill = flag
        scheduler.add(make_request("first", 9))
        out = scheduler.schedule(lambda request: 4)
        scheduler.update_from_output(out, [[3]])  # its prompt's blocks are cached now
        scheduler.add(make_request("again", 9))
        out = scheduler.schedule(lambda request: 4)
        again = next(s for s in out.scheduled if s.request.request_id == "again")
        assert (again.num_new_tokens, again.num_lookahead) == (1, expected)


def test_where_it_would_not_be_lossless_it_is_off_and_refused_when_asked():
    ngram = NgramProposer()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert drafts_at_prefill(None, ngram, cpu, torch.float32)
    assert not drafts_at_prefill(False, ngram, cpu, torch.float32)
    # a chunk's attention on CUDA (SDPA) is not computed as decode rows are
    assert not drafts_at_prefill(None, ngram, cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="--draft-at-prefill"):
        drafts_at_prefill(True, ngram, cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="speculative-method none"):
        drafts_at_prefill(True, None, cpu, torch.float32)

    class HeadProposer(NgramProposer):
        name = "eagle"
        drafts_at_prefill = False

    assert not drafts_at_prefill(None, HeadProposer(), cpu, torch.float32)
    with pytest.raises(ValueError, match="eagle"):
        drafts_at_prefill(True, HeadProposer(), cpu, torch.float32)
