"""Suffix decoding through the engine: seeded sampling gives `none`'s very tokens, before and
after the global cache holds earlier outputs; a repeated prompt drafts from the earlier output."""

from __future__ import annotations

import dataclasses

from engine import SamplingParams
from tests.conftest import make_llm
from tests.engine.test_spec_decode_engine import PROMPTS

SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)


def _seeded(llm, seed_offset: int = 0):
    params = [dataclasses.replace(SEEDED, seed=SEEDED.seed + seed_offset + i)
              for i in range(len(PROMPTS))]
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_seeded_sampling_with_suffix_equals_none_and_the_cache_is_used():
    plain = _seeded(make_llm(speculative_method="none"))
    llm = make_llm(speculative_method="suffix", adaptive=False, num_speculative_tokens=4)
    assert _seeded(llm) == plain
    first_pass = llm.engine.scheduler.spec_stats.snapshot()
    assert _seeded(llm) == plain  # again, now drafting from the first pass's outputs
    stats = llm.engine.scheduler.spec_stats
    accepted_again = stats.num_accepted_tokens - first_pass.num_accepted_tokens
    assert accepted_again > 2 * max(first_pass.num_accepted_tokens, 10)
    assert stats.draft_tokens_by_method.get("suffix", 0) == stats.num_draft_tokens
    # negative control: other seeds sample other tokens, so equality above is not vacuous
    assert _seeded(llm, seed_offset=100) != plain
