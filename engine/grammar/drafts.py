"""Drafts under a grammar: the grammar's forced tokens as free drafts, and proposers' drafts cut
where the grammar would refuse them.

Losslessness. A forced or proposed token sequence that does not depend on the target's randomness
is a draft with a one-hot distribution, so it can be cut anywhere. A draft *sampled* from a draft
distribution q cannot: choosing the draft's length by looking at a later sampled token biases the
tokens before it. Such a draft keeps its first disallowed token (the target's masked p gives it
probability 0, so it is rejected and the recovered token is drawn from max(0, p - q) as the
theorem needs) and loses only what follows it.
"""

from __future__ import annotations

import torch

from engine.grammar.backend import GrammarMatcher


def constrain_drafts(grammar: GrammarMatcher, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None, max_drafts: int,
                     greedy: bool) -> tuple[list[int], torch.Tensor | None, int]:
    """Returns (drafts, their distributions or None, how many of them the grammar forced)."""
    forced = grammar.forced_tokens()[:max_drafts]
    if forced:
        return forced, None, len(forced)
    num_valid = grammar.valid_prefix(draft_token_ids)
    if num_valid == len(draft_token_ids):
        return draft_token_ids, draft_probs, 0
    if draft_probs is None or greedy:
        return draft_token_ids[:num_valid], None, 0
    keep = num_valid + 1
    return draft_token_ids[:keep], draft_probs[:keep], 0
