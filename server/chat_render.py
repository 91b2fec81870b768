"""Chat templates rendered with jinja2 alone, as transformers' `apply_chat_template(...,
tokenize=False)` renders them, for the template workers (server/template_worker.py).

Importing transformers' renderer costs a worker ~40 MB (57 MB against 19 MB resident), twice over
with two workers. This module defines the same environment: Jinja's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, loop controls, a `{% generation %}` block that renders its body,
and the globals and filter templates use (`raise_exception`, `strftime_now`, `dict`, a
`namespace` that refuses underscore names, `tojson` without HTML escaping). Messages arrive as
JSON, so they are plain data already; a message's reasoning is aliased under the names templates
read, as transformers does. tests/server/test_chat_templates.py checks the text is transformers'
for templates that use each of these.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Names a message's reasoning comes under; templates read the first (gpt-oss's read `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    rendering for inference outputs the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class TemplateNamespace(Namespace):
    """`namespace(...)` whose attributes cannot start with "_" (no way into CPython internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            TemplateNamespace._check(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, without handing the template the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def raise_exception(message):
    raise TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                               dict=TemplateDict(), namespace=TemplateNamespace)
    return environment.from_string(source)


def with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None),
                     None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(source: str, messages: list[dict], tools: list[dict] | None,
                add_generation_prompt: bool, special_tokens: dict) -> str:
    """The prompt text; a template's own failure raises (TemplateError and others)."""
    # As transformers normalizes messages: keys whose value is None are dropped.
    chat = [with_reasoning_aliases({k: v for k, v in m.items() if v is not None})
            for m in messages]
    return compile_template(source).render(
        messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
        **special_tokens)
