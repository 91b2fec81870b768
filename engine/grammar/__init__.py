"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled into per-request
matchers that give token masks, advance on accepted tokens and name forced tokens. llguidance is
the backend (see backend.py for why)."""

from engine.grammar.backend import GrammarCompiler, GrammarError, GrammarMatcher
from engine.grammar.constraint import Constraint

__all__ = ["Constraint", "GrammarCompiler", "GrammarError", "GrammarMatcher"]
