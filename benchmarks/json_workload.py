"""The JSON workload of the structured-output benchmarks: schemas of varied shape over the bundled
prompts, and tool calls.

  summary   MT-Bench first turns answered as {title, summary, keywords[]}    (flat, free strings)
  steps     MT-Bench first turns answered as {steps[{number, action}], answer} (nested array)
  function  HumanEval prompts described as {name, parameters[{name, type}], returns, examples[]}
            (enums, nested objects, short strings)
  tools     MT-Bench first turns with three tools and tool_choice "required": the server's own
            schema of a call array (one anyOf branch per tool), prompt written by its fallback

Each item is a chat prompt (the schema is also stated in a system message, as users do) with the
constraint the server would build for it and the JSON schema its output must satisfy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specserve.bench.workloads import load_workloads
from engine.grammar import Constraint
from server.protocol import ChatCompletionRequest
from server.tools import conversation, plan_tools

SHAPES = ("summary", "steps", "function", "tools")

_STRING = {"type": "string", "maxLength": 60}
SCHEMAS = {
    "summary": {"type": "object", "additionalProperties": False,
                "required": ["title", "summary", "keywords"],
                "properties": {"title": _STRING,
                               "summary": {"type": "string", "maxLength": 400},
                               "keywords": {"type": "array", "items": {"type": "string",
                                                                        "maxLength": 20},
                                            "maxItems": 5}}},
    "steps": {"type": "object", "additionalProperties": False, "required": ["steps", "answer"],
              "properties": {
                  "steps": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                      "type": "object", "additionalProperties": False,
                      "required": ["number", "action"],
                      "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "action": {"type": "string", "maxLength": 100}}}},
                  "answer": {"type": "string", "maxLength": 200}}},
    "function": {"type": "object", "additionalProperties": False,
                 "required": ["name", "parameters", "returns", "examples"],
                 "properties": {
                     "name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,39}$"},
                     "parameters": {"type": "array", "maxItems": 4, "items": {
                         "type": "object", "additionalProperties": False,
                         "required": ["name", "type"],
                         "properties": {"name": {"type": "string", "maxLength": 20},
                                        "type": {"enum": ["int", "float", "str", "list",
                                                          "dict", "bool"]}}}},
                     "returns": {"enum": ["int", "float", "str", "list", "dict", "bool",
                                          "None"]},
                     "examples": {"type": "array", "maxItems": 2, "items": {
                         "type": "object", "additionalProperties": False,
                         "required": ["call", "result"],
                         "properties": {"call": _STRING, "result": _STRING}}}}},
}
TOOLS = [
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["query", "max_results"],
                       "properties": {"query": {"type": "string", "maxLength": 80},
                                      "max_results": {"type": "integer", "minimum": 1,
                                                      "maximum": 10}}}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "run_python", "description": "Run a Python snippet and return its output",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["code"],
                       "properties": {"code": {"type": "string", "maxLength": 300}}}}},
]


@dataclass(frozen=True)
class JsonItem:
    id: str  # "<shape>/<prompt id>"
    shape: str
    prompt_ids: list[int]
    constraint: Constraint
    schema: dict  # what a finished output must satisfy


def load_json_items(tokenizer, num_prompts: int, shapes=SHAPES) -> list[JsonItem]:
    """`num_prompts` items of every shape, the shapes interleaved."""
    chat = load_workloads("chat", num_prompts)
    code = load_workloads("code", num_prompts)
    items = []
    for index in range(num_prompts):
        for shape in shapes:
            source = code if shape == "function" else chat
            if index < len(source):
                items.append(_item(tokenizer, shape, source[index]))
    return items


def _item(tokenizer, shape: str, workload) -> JsonItem:
    if shape == "tools":
        body = ChatCompletionRequest(model="m", tools=TOOLS, tool_choice="required",
                                     messages=[{"role": "user", "content": workload.text}])
        plan = plan_tools(body)
        messages, _ = conversation(body, plan, native=False)
        constraint = plan.constraint
        schema = json.loads(constraint.spec)
    else:
        schema = SCHEMAS[shape]
        text = (f"Describe this Python function as JSON.\n\n```python\n{workload.text}```"
                if shape == "function" else workload.text)
        messages = [{"role": "system", "content": "Reply with one JSON object that follows this "
                     f"JSON schema: {json.dumps(schema)}"},
                    {"role": "user", "content": text}]
        constraint = Constraint.json_schema(schema)
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return JsonItem(f"{shape}/{workload.id.split('/', 1)[1]}", shape,
                    list(encoded["input_ids"]), constraint, schema)


def is_valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
