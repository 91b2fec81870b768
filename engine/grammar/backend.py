"""The grammar backend: llguidance.

Chosen over xgrammar by `benchmarks/experiments/grammar_backends.py` on this CPU: both compute a token mask
in a fraction of a millisecond, but llguidance compiles lazily (a schema costs ~2 ms before its
first mask, xgrammar's compiler ~200 ms), names the tokens the grammar forces (free drafts), has
rollback for speculation, bounds the work of every mask by its parser limits, and installs as one
3 MB wheel with no dependencies (xgrammar brings a TVM runtime and triton).

A `GrammarCompiler` belongs to one tokenizer and is shared by the server (which compiles off the
event loop and off the engine's thread, so a slow grammar delays only its own request) and the
engine (which copies a compiled matcher per request). Compiled matchers are cached per constraint.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from engine.grammar.constraint import Constraint, grammar_text
from engine.grammar.probe import ProbeTimeout, probe, schema_patterns
from engine.grammar.vocabulary import grammar_tokenizer

CACHE_SIZE = 256  # compiled constraints kept
# llguidance's own limits, the same for compiling, probing and every request's masks. Its defaults,
# except two. The lexer's states (1-2 kB each): 50,000 of them bound one grammar's lexer to
# ~100 MB. The initial lexer fuel: at 200,000 (not 1,000,000) `a{1000000}` is refused in ~0.1 s,
# not 0.5-1.7 s, and a schema of 1,900 required properties or a choice of 20,000 options still
# compile.
PARSER_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=200_000,
                     step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=50_000,
                     max_grammar_size=500_000, verbose_errors=False)


class GrammarError(ValueError):
    """A constraint that does not compile: the message is the backend's, fit for a client."""


class GrammarMatcher:
    """One request's position in its grammar. Advances only by tokens the request emitted;
    speculation looks ahead with `fill_masks`, which leaves the state where it was."""

    def __init__(self, matcher, eos_token_ids: Iterable[int], num_mask_words: int):
        self._matcher = matcher
        self._eos = sorted(eos_token_ids)
        self.num_mask_words = num_mask_words  # int32 words of one row of its bitmask
        self._num_ahead = 0  # draft tokens consumed by `look_ahead`, to be rolled back

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advances by emitted tokens; False (and the matcher in error) if one is not allowed.
        A grammar that can go no further stops by itself; only an end-of-text token follows."""
        for token_id in token_ids:
            if self._matcher.is_stopped():
                if token_id not in self._eos:
                    return False
            elif not self._matcher.consume_token(token_id):
                return False
        return True

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens the grammar allows from here (state unchanged)."""
        if not token_ids:
            return 0
        if self._matcher.is_stopped():
            return int(token_ids[0] in self._eos)
        num_valid = self._matcher.validate_tokens(list(token_ids))
        if 0 < num_valid < len(token_ids) and token_ids[num_valid] in self._eos:
            # validate_tokens refuses the end-of-text token after a match that stops by itself
            self._matcher.consume_tokens(list(token_ids[:num_valid]))
            stopped = self._matcher.is_stopped()
            self._matcher.rollback(num_valid)
            num_valid += stopped
        return num_valid

    def look_ahead(self, token_ids: Sequence[int]) -> int:
        """Moves the state past the leading draft tokens the grammar allows, until
        `roll_back_look_ahead`; returns how many of `token_ids` are allowed drafts (a refused
        token ends them, and so does the end of the text: an end-of-text token after a complete
        match counts as allowed, and is the last)."""
        consumed = 0 if self._matcher.is_stopped() else \
            self._matcher.try_consume_tokens(list(token_ids))
        self._num_ahead += consumed
        rest = token_ids[consumed:]
        return consumed + int(bool(rest) and self._matcher.is_stopped() and rest[0] in self._eos)

    def roll_back_look_ahead(self) -> None:
        if self._num_ahead:
            self._matcher.rollback(self._num_ahead)
            self._num_ahead = 0

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar fixes from here, whatever the model would say (keys, punctuation,
        closing brackets): drafts that cost no model work."""
        forced = self._matcher.compute_ff_tokens()
        return forced[:self.valid_prefix(forced)]

    def fill_masks(self, bitmask: torch.Tensor, row: int, draft_token_ids: Sequence[int]) -> None:
        """Writes allowed-token bits for the position after each of draft_token_ids[:j], j =
        0..len, into rows row + j of `bitmask` ([rows, words] int32 on the host). Rows past a
        draft the grammar does not allow are left as they are: a verifier never reaches them, as
        such a draft is always rejected."""
        # Words read and written through a numpy view of the host tensor and raw row pointers:
        # torch's indexing and reductions cost ~20 us a row here, a third of the mask itself.
        words, base = bitmask.numpy(), bitmask.data_ptr()
        consumed = 0
        self._fill(words, base, row)
        for token_id in draft_token_ids:
            # Checked against the row's mask first: consuming a refused token (a sampled draft
            # keeps one) would put the matcher in an error state that rollback does not undo.
            if self._matcher.is_stopped() or not _allows(words[row + consumed], token_id):
                break
            self._matcher.consume_token(token_id)
            consumed += 1
            self._fill(words, base, row + consumed)  # a complete match: end-of-text only
        if consumed:
            self._matcher.rollback(consumed)

    def _fill(self, words, base: int, row: int) -> None:
        """Row `row` of the bitmask whose numpy view is `words` and whose data is at `base`."""
        row_bytes = words.shape[1] * 4
        # A matcher in error also reads as stopped: asked first, it is never taken for a
        # complete match (which once let a grammar past its limits end with "stop").
        stopped = not self._matcher.is_error() and self._matcher.is_stopped()
        if not stopped and not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        if not stopped and (self._matcher.is_error() or not words[row].any()):
            # A grammar past its limits, or at a dead end: never text it does not allow.
            raise GrammarError(_first_line(self._matcher.get_error()) or
                               "the grammar allows no token here")
        if stopped:  # a complete match ends the text
            words[row] = 0
            for token_id in self._eos:
                words[row, token_id // 32] |= _bit(token_id % 32)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else error


def _allows(row_words, token_id: int) -> bool:
    return token_id < row_words.shape[0] * 32 and bool(
        (int(row_words[token_id // 32]) >> (token_id % 32)) & 1)


def _bit(index: int) -> int:
    return 1 << index if index < 31 else -(1 << 31)  # bit 31 of an int32


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._hf_tokenizer = tokenizer
        # The grammar sees every token the tokenizer has (a model may have fewer rows in its
        # LM head, as the tests' tiny models do; masks are cut to the logits' width).
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer = None
        # Keyed by the constraint, whose spec is canonical text (a schema as json.dumps writes
        # it, however the client spaced it): compiled matchers, and the errors of those that
        # failed.
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._failed: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's view of the vocabulary, built once, on the first constraint (~0.2 s on a
        compiling thread, ~0.1 s of it holding the GIL; see vocabulary.py)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(self._hf_tokenizer, self.vocab_size,
                                                    sorted(self.eos_token_ids) or None)
            return self._tokenizer

    def compile(self, constraint: Constraint, deadline: float | None = None):
        """The compiled matcher of a constraint, cached; raises GrammarError, also for a grammar
        whose compilation and probe run past `deadline` (time.monotonic())."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
            if constraint in self._failed:  # the same hostile spec, sent again, costs nothing
                raise GrammarError(self._failed[constraint])
        try:
            matcher = self._compile(constraint, deadline)
        except GrammarError as error:
            if "took too long" not in str(error):  # a busier moment may finish it
                self._remember(self._failed, constraint, str(error))
            raise
        self._remember(self._cache, constraint, matcher)
        return matcher

    def _remember(self, cache: OrderedDict, constraint: Constraint, value) -> None:
        with self._lock:
            cache[constraint] = value
            while len(cache) > CACHE_SIZE:
                cache.popitem(last=False)

    def _compile(self, constraint: Constraint, deadline: float | None):
        try:
            grammar = grammar_text(constraint)
        except ValueError as error:
            raise GrammarError(str(error)) from None
        what = constraint.kind.replace("_", " ")
        matcher = self._new_matcher(grammar)
        try:
            # The first masks build the lexer: an error there (a limit hit) is the grammar's too.
            error = matcher.get_error() if matcher.is_error() else \
                probe(matcher, self.vocab_size, self.eos_token_ids, deadline)
            if not error and constraint.kind == "json_schema":
                error = self._probe_patterns(constraint.spec, deadline)
        except ProbeTimeout:
            raise GrammarError(f"the {what} took too long to compile and check") from None
        if error:
            raise GrammarError(f"invalid {what}: {_first_line(error)}")
        return matcher

    def _new_matcher(self, grammar: str):
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                    limits=llguidance.LLParserLimits(**PARSER_LIMITS))

    def _probe_patterns(self, schema_text: str, deadline: float | None) -> str | None:
        """Each pattern of the schema alone, as a string of its own (so translated as the
        schema's own are): an error names the pattern."""
        from llguidance import LLMatcher

        for pattern in schema_patterns(schema_text):
            matcher = self._new_matcher(LLMatcher.grammar_from_json_schema(
                {"type": "string", "pattern": pattern}))
            error = matcher.get_error() if matcher.is_error() else \
                probe(matcher, self.vocab_size, self.eos_token_ids, deadline, num_walks=1)
            if error:
                return f"pattern {pattern[:80]!r}: {_first_line(error)}"
        return None

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        return GrammarMatcher(self.compile(constraint).deep_copy(), self.eos_token_ids,
                              (self.vocab_size + 31) // 32)
