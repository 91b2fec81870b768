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

from collections.abc import Callable, Sequence

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


Guess = Callable[[Sequence[int], int, Callable[[list[int]], int]], list[int]]


def interleave_drafts(grammar: GrammarMatcher, guess: Guess, max_drafts: int,
                      max_guessed: int) -> tuple[list[int], list[bool]]:
    """Drafts that alternate the grammar's forced tokens and a deterministic proposer's guesses,
    each made after the drafts before it: keys and punctuation from the grammar, the values
    between them from the proposer. `guess(drafts, n, valid_prefix)`: up to n tokens to follow
    the context and `drafts`, which the grammar's `valid_prefix` allows. At most `max_drafts`
    tokens, of which at most `max_guessed` guessed (the controller's plan). Every draft is a
    deterministic function of the context, so any cut is lossless (see above). Returns the
    drafts and, per draft, whether the grammar forced it."""
    drafts: list[int] = []
    forced_flags: list[bool] = []
    try:
        while len(drafts) < max_drafts and not grammar.is_terminated:
            room = max_drafts - len(drafts)
            tokens = grammar.forced_tokens()[:room]
            forced = bool(tokens)
            if not forced and max_guessed > 0:
                asked = min(room, max_guessed)
                tokens = guess(drafts, asked, grammar.valid_prefix)[:asked]
            # All of a guess that kept to valid_prefix; cut at a token the grammar refuses.
            allowed = grammar.look_ahead(tokens)
            if not allowed:
                break
            max_guessed -= 0 if forced else allowed
            drafts += tokens[:allowed]
            forced_flags += [forced] * allowed
    finally:
        grammar.roll_back_look_ahead()
    return drafts, forced_flags
