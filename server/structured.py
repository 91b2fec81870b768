"""Structured-output requests: `response_format`, vLLM's `structured_outputs` and `guided_*`
fields turned into one engine `Constraint`, checked and compiled off the event loop.

Every mistake is a 400 naming the field: two constraints at once, a schema that is not a JSON
schema (checked with jsonschema's meta-schemas) or that the grammar backend cannot compile, a bad
regex or grammar, a spec too large, or one that takes too long to compile.
"""

from __future__ import annotations

import asyncio
import json

from engine.grammar import Constraint, GrammarError
from server.errors import bad_request
from server.protocol import SamplingFields

MAX_SPEC_CHARS = 100_000  # a schema or grammar larger than this is refused
COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer to compile is refused


def requested_constraint(body: SamplingFields) -> tuple[Constraint | None, str | None]:
    """(the request's constraint or None, the parameter it came from, as errors name it)."""
    found = []  # (top-level field, constraint, parameter)
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", *_response_format(body)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", *_structured_outputs(body.structured_outputs)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            found.append((field, _constraint(kind, value, field), field))
    if len(found) > 1:
        raise bad_request("only one of response_format, structured_outputs and guided_* may "
                          f"constrain the output; got {', '.join(f for f, _, _ in found)}",
                          found[1][0])
    if not found:
        return None, None
    _, constraint, param = found[0]
    if body.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with a structured output", "ignore_eos")
    return constraint, param


def _response_format(body: SamplingFields) -> tuple[Constraint, str]:
    response_format = body.response_format
    if response_format.type == "json_object":
        return Constraint("json_object"), "response_format"
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          "response_format.json_schema")
    param = "response_format.json_schema.schema"
    return _constraint("json", spec.json_schema, param), param


def _structured_outputs(spec) -> tuple[Constraint, str]:
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
    param = f"structured_outputs.{kind}"
    return _constraint(kind, value, param), param


def _constraint(kind: str, value, param: str) -> Constraint:
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        if not all(value):
            raise bad_request("choices must be non-empty strings", param)
        return Constraint.choice(value)
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as error:
                raise bad_request(f"the JSON schema is not valid JSON: {error}", param) from None
        check_json_schema(schema, param)
        constraint = Constraint.json_schema(schema)
    else:
        constraint = Constraint(kind, value)
    if len(constraint.spec) > MAX_SPEC_CHARS:
        raise bad_request(f"the {kind} is {len(constraint.spec)} characters long; the limit is "
                          f"{MAX_SPEC_CHARS}", param)
    return constraint


def check_json_schema(schema, param: str) -> None:
    """A 400 for anything that is not a valid JSON schema (by its own draft's meta-schema)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise bad_request("a JSON schema must be an object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise bad_request(f"invalid JSON schema{' at ' + where if where else ''}: "
                          f"{error.message}", param) from None


async def compile_constraint(engine, constraint: Constraint, param: str) -> float:
    """Compiles (or finds cached) off the event loop and the engine's thread; seconds taken."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await asyncio.wait_for(asyncio.to_thread(engine.grammars.compile, constraint),
                               COMPILE_TIMEOUT_S)
    except GrammarError as error:
        raise bad_request(str(error), param) from None
    except TimeoutError:
        raise bad_request(f"the {constraint.kind.replace('_', ' ')} took more than "
                          f"{COMPILE_TIMEOUT_S:g} s to compile", param) from None
    return loop.time() - started


async def prepare_constraint(context, body: SamplingFields, tool_plan=None) -> Constraint | None:
    """The request's constraint (its own, or the one its tool choice implies), compiled and
    counted in the metrics by kind."""
    constraint, param = requested_constraint(body)
    kind = constraint.kind if constraint is not None else None
    if tool_plan is not None and tool_plan.constraint is not None:
        if constraint is not None:
            raise bad_request(f"tool_choice {tool_plan.mode} cannot be combined with {param}",
                              param)
        constraint, param = tool_plan.constraint, "tool_choice"
    if tool_plan is not None and tool_plan.mode != "none" and kind is None:
        kind = f"tools_{tool_plan.mode}"
    seconds = None
    if constraint is not None:
        seconds = await compile_constraint(context.engine, constraint, param)
    if kind is not None and context.server_metrics is not None:
        context.server_metrics.record_structured(kind, seconds)
    return constraint
