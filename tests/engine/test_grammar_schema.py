"""JSON schemas read as xgrammar and llama.cpp read them (engine/grammar/schema.py): an object
schema that lists properties refuses other keys unless `additionalProperties` allows them."""

from __future__ import annotations

import pytest

from engine.grammar.schema import close_objects

LISTED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_listed_properties_close_the_object_everywhere_it_nests():
    schema = {"type": "object", "properties": {
        "inner": LISTED, "items": {"type": "array", "items": LISTED},
        "either": {"anyOf": [LISTED, {"type": "string"}]}},
        "$defs": {"d": LISTED}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["inner"]["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.parametrize("own", [{"additionalProperties": True},
                                 {"additionalProperties": {"type": "string"}},
                                 {"patternProperties": {"^x": {}}}])
def test_a_schema_that_chooses_keeps_its_choice(own):
    closed = close_objects({**LISTED, **own})
    for key, value in own.items():
        assert closed[key] == value
    if "additionalProperties" not in own:
        assert "additionalProperties" not in closed


def test_objects_without_properties_and_allof_members_stay_open():
    assert close_objects({"type": "object"}) == {"type": "object"}
    closed = close_objects({"allOf": [LISTED, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in member for member in closed["allOf"])


@pytest.fixture(scope="module")
def compiler(default_model_folder):
    from transformers import AutoTokenizer

    from engine.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


@pytest.mark.parametrize("schema, extra_allowed", [
    (LISTED, False),
    ({**LISTED, "additionalProperties": True}, True),
])
def test_the_grammar_refuses_an_unlisted_key_unless_allowed(compiler, schema, extra_allowed):
    """The control: the listed key alone is accepted under both schemas."""
    from engine.grammar import Constraint

    grammars, tokenizer = compiler

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(Constraint.json_schema(schema))
        return matcher.accept(tokenizer(text, add_special_tokens=False)["input_ids"])

    assert accepts('{"a": 1}')
    assert accepts('{"a": 1, "zzz": 2}') == extra_allowed
