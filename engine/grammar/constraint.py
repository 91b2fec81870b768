"""What a request constrains its output to, as plain data, and its llguidance grammar text.

The kinds are the union of OpenAI's `response_format` and vLLM's `structured_outputs`:
- `json_schema`: `spec` is the schema as JSON text;
- `json_object`: any JSON object (`spec` unused);
- `regex`: a regular expression (Rust `regex` syntax, as llguidance and vLLM's backends read it);
- `choice`: `spec` is a JSON list of the allowed strings;
- `grammar`: a Lark grammar (llguidance's dialect) or a GBNF one (`root ::= ...`, llama.cpp's and
  xgrammar's EBNF), told apart by `::=`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.grammar.schema import close_objects

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# JSON is written as `json.dumps` writes it ("a": 1, "b": [1, 2]): the style models emit on their
# own, and with no freedom in whitespace, keys and punctuation become forced tokens (free drafts).
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Constraint:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        return cls("json_schema", json.dumps(schema))  # key order is the output order

    @classmethod
    def choice(cls, options: list[str]) -> "Constraint":
        return cls("choice", json.dumps(list(options)))


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (a JSON document naming one grammar).

    Raises ValueError for a spec that is not what its kind needs (the grammar's own errors come
    from compiling it, in backend.py)."""
    from llguidance import LLMatcher

    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_schema", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _json(spec, "schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        schema = close_objects(schema)  # unlisted properties refused unless allowed
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        options = _json(spec, "choice")
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes, so any text is one literal. One terminal
        # (a single lexer regex), not one rule per option: an Earley row holds at most 2,000
        # items, and 5,000 alternatives in a rule failed after the first token.
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in dict.fromkeys(options)))
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec))  # GBNF converted, Lark kept
    except GbnfToLarkError as error:
        raise ValueError(f"invalid GBNF grammar: {error}") from None


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the {what} is not valid JSON: {error}") from None
