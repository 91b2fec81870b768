"""Structured-output requests: `response_format`, vLLM's `structured_outputs` and `guided_*`
fields turned into one engine `Constraint`, checked and compiled off the event loop.

Every mistake is a 400 naming the field: two constraints at once, a schema that is not a JSON
schema (checked with jsonschema's meta-schemas) or that the grammar backend cannot compile or
run (its first masks are computed, under its limits, before admission), a bad regex or grammar,
a spec too large or too deep, or one that takes too long to compile.

On the event loop a request only finds its constraint and weighs it (bounded work); the size and
depth limits, the schema check and the compilation run in that order on a worker
(`server/grammar_gate.py`).
"""

from __future__ import annotations

import json
from functools import partial

from engine.grammar import Constraint, GrammarError
from server.errors import bad_request
from server.grammar_gate import GateTimeout, is_large
from server.protocol import SamplingFields

MAX_SPEC_CHARS = 100_000  # a schema, grammar or list of choices larger than this is refused
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema
# Optional properties of one object: llguidance puts them all in one parser row, which holds at
# most 2,000 items (about 498 properties); a larger object compiles slowly and fails at its
# first key, so it is refused before compiling.
MAX_OPTIONAL_PROPERTIES = 450


def requested_spec(body: SamplingFields) -> tuple[str, object, str] | None:
    """(kind, raw value, the parameter errors name) of the request's constraint, or None;
    cheap checks only."""
    found = []  # (top-level field, kind, value, parameter)
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", *_response_format(body)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", *_structured_outputs(body.structured_outputs)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            found.append((field, kind, value, field))
    if len(found) > 1:
        raise bad_request("only one of response_format, structured_outputs and guided_* may "
                          f"constrain the output; got {', '.join(f[0] for f in found)}",
                          found[1][0])
    if not found:
        return None
    if body.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with a structured output", "ignore_eos")
    return found[0][1:]


def _response_format(body: SamplingFields) -> tuple[str, object, str]:
    response_format = body.response_format
    if response_format.type == "json_object":
        return "json_object", None, "response_format"
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          "response_format.json_schema")
    return "json", spec.json_schema, "response_format.json_schema.schema"


def _structured_outputs(spec) -> tuple[str, object, str]:
    given = {name: value for name, value in (("json", spec.json_), ("regex", spec.regex),
                                             ("choice", spec.choice), ("grammar", spec.grammar))
             if value is not None}
    if spec.json_object:
        given["json_object"] = True
    if len(given) != 1:
        raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar "
                          f"and json_object; got {', '.join(given) or 'none'}",
                          "structured_outputs")
    (kind, value), = given.items()
    return kind, value, f"structured_outputs.{kind}"


def build_constraint(kind: str, value, param: str) -> Constraint:
    """The constraint, its size checked before anything parses it (on a worker: a schema's text
    and check cost time in proportion to its size)."""
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        if not all(value):
            raise bad_request("choices must be non-empty strings", param)
        constraint = Constraint.choice(value)
        _check_size(constraint.spec, "list of choices", param)
        return constraint
    if kind != "json":
        _check_size(value, kind, param)
        return Constraint(kind, value)
    text = value if isinstance(value, str) else json.dumps(value)
    _check_size(text, "JSON schema", param)
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as error:
            raise bad_request(f"the JSON schema is not valid JSON: {error}", param) from None
    check_json_schema(schema, param)
    return Constraint.json_schema(schema)


def _check_size(text: str, what: str, param: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise bad_request(f"the {what} is {len(text)} characters long; the limit is "
                          f"{MAX_SPEC_CHARS}", param)


def check_json_schema(schema, param: str) -> None:
    """A 400 for anything that is not a valid JSON schema (by its own draft's meta-schema), or
    that breaks the shape limits (checked first: the meta-schema check is the slow part)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise bad_request("a JSON schema must be an object", param)
    _check_shape(schema, param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise bad_request(f"invalid JSON schema{' at ' + where if where else ''}: "
                          f"{error.message}", param) from None


def _check_shape(schema, param: str) -> None:
    """Depth and optional properties per object, without recursion."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad_request(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep",
                              param)
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES:
                required = node.get("required")
                required = set(required) if isinstance(required, list) and \
                    all(isinstance(name, str) for name in required) else set()
                optional = len(properties.keys() - required)
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise bad_request(
                        f"an object in the JSON schema has {optional} optional properties; "
                        f"the grammar engine takes at most {MAX_OPTIONAL_PROPERTIES}", param)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)


def _check_and_compile(compiler, spec, tool_schemas, tool_constraint, deadline: float):
    """On a worker: every check in order, then the compilation. Returns the constraint."""
    for schema, param in tool_schemas:
        check_json_schema(schema, param)
    if spec is not None:
        constraint, param = build_constraint(*spec), spec[2]
    elif tool_constraint is not None:
        constraint, param = tool_constraint, "tool_choice"
    else:
        return None
    try:
        compiler.compile(constraint, deadline)
    except GrammarError as error:
        raise bad_request(str(error), param) from None
    return constraint


async def prepare_constraint(context, body: SamplingFields, tool_plan=None) -> Constraint | None:
    """The request's constraint (its own, or the one its tool choice implies), its tools'
    parameter schemas checked, compiled and counted in the metrics by kind."""
    spec = requested_spec(body)
    kind = None if spec is None else ("json_schema" if spec[0] == "json" else spec[0])
    tool_constraint = None
    if tool_plan is not None and tool_plan.constraint is not None:
        if spec is not None:
            raise bad_request(f"tool_choice {tool_plan.mode} cannot be combined with {spec[2]}",
                              spec[2])
        tool_constraint = tool_plan.constraint
    if tool_plan is not None and tool_plan.mode != "none" and kind is None:
        kind = f"tools_{tool_plan.mode}"
    tools = getattr(body, "tools", None) or []
    tool_schemas = [(tool.function.parameters, f"tools.{index}.function.parameters")
                    for index, tool in enumerate(tools) if tool.function.parameters is not None]
    if spec is None and tool_constraint is None and not tool_schemas:
        return None
    weighed = [schema for schema, _ in tool_schemas]
    weighed += [spec[1]] if spec is not None else [tool_constraint.spec] if tool_constraint else []
    gate = context.grammar_gate
    work = partial(_check_and_compile, context.engine.grammars, spec, tool_schemas,
                   tool_constraint)
    started = gate.now()
    try:
        constraint = await gate.run(work, large=is_large(weighed))
    except GateTimeout:
        param = spec[2] if spec is not None else "tool_choice" if tool_constraint else "tools"
        raise bad_request(f"the structured output took more than {gate.timeout_s:g} s to check "
                          "and compile", param) from None
    seconds = gate.now() - started if constraint is not None else None
    if kind is not None and context.server_metrics is not None:
        context.server_metrics.record_structured(kind, seconds)
    return constraint
