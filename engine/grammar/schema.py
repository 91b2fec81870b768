"""JSON schemas read as xgrammar and llama.cpp read them: an object schema that lists its
`properties` allows no other keys unless it says so.

The JSON Schema standard lets an object carry any key it does not list. Under constrained
decoding that freedom lets a small model invent keys without end (`"population_density_per_
square_kilometer_per_..."`) until `max_tokens` cuts the JSON. vLLM's default backend and llama.cpp
both treat a missing `additionalProperties` as false; so does this module, before llguidance sees
the schema. A schema that sets `additionalProperties` (or `patternProperties`,
`unevaluatedProperties`) keeps its own choice.
"""

from __future__ import annotations

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema):
    """A copy of `schema` in which every object schema with `properties` and none of
    `additionalProperties`, `patternProperties` or `unevaluatedProperties` has
    `"additionalProperties": false`. Members of an `allOf` are left open (each lists only part
    of the keys the whole allows), though what they contain is closed."""
    return _close(schema, closable=True)


def _close(schema, closable: bool):
    if isinstance(schema, list):  # a tuple-form `items` of draft 4
        return [_close(item, True) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = _close(value, True)
        elif key in _MANY and isinstance(value, list):
            out[key] = [_close(item, True) for item in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(item, False) for item in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: _close(item, True) for name, item in value.items()}
        else:
            out[key] = value
    if closable and "properties" in out and not any(key in out for key in _OPEN_KEYS) \
            and "allOf" not in out:
        out["additionalProperties"] = False
    return out
