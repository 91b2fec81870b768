"""The chat-template renderer pool (server/templates.py) on its own: it renders exactly as
transformers does, a template that spins, grows, floods or recurses is stopped while the pool
keeps serving (the pool's size: test_template_pool.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.errors import APIError
from server.templates import ChatTemplates, TemplateLimitError, TemplateLimits

# Hostile on demand: the first message's content picks the attack, anything else renders plainly.
HOSTILE_TEMPLATE = (
    "{% set attack = messages[0].content %}"
    "{% if attack == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if attack == 'grow' %}{% set s = 'x' * 3000000000 %}{{ s | length }}{% endif %}"
    "{% if attack == 'flood' %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endif %}"
    "{% macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}"
    "{% if attack == 'recurse' %}{{ deeper(0) }}{% endif %}"
    "{% if attack == 'refuse' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that renders tools and tool calls, in the Hermes style of Qwen2's.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}"
    "{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function | tojson }}</tool_call>{% endfor %}{% if m.tool_call_id is defined %}"
    " ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What templates of other families use: a namespace, loop controls, a generation block, tojson's
# options, dict(), the reasoning field under its aliases, and an underscore namespace attribute
# (refused by both renderers).
FEATURES_TEMPLATE = (
    "{% set ns = namespace(turns=0) %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.turns = ns.turns + 1 %}"
    "{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n"
    "{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}"
    "{% if loop.index > 4 %}{% break %}{% endif %}{% endfor %}"
    "{{ dict(turns=ns.turns, first=messages[0].role) | tojson(indent=2, sort_keys=true) }}"
    "{% if tools %}{{ tools | tojson(separators=(',', ':')) }}{% endif %}"
    "{% if messages[0].content == 'Escape' %}{% set ns._secret = 1 %}{% endif %}"
    "{% if add_generation_prompt %}{{ bos_token }}A:{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo ✓ \u2028"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "21 C", "tool_call_id": "c1"}],
    [{"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because.", "reasoning": "short <b>&</b> ✓"},
     {"role": "user", "content": "More"}, {"role": "assistant", "content": "No."},
     {"role": "user", "content": "5"}, {"role": "user", "content": "6"}],
    [{"role": "user", "content": "Escape"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


SPIN = [{"role": "user", "content": "spin"}]
PLAIN = [{"role": "user", "content": "hi"}]
PLAIN_TEXT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _run(coroutine_function, limits=TemplateLimits(timeout_s=2.0), special_tokens=None):
    async def main():
        pool = ChatTemplates(special_tokens or {"bos_token": "<s>"}, limits)
        await pool.start()
        try:
            return await coroutine_function(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


@pytest.mark.parametrize("template", ["model", TOOLS_TEMPLATE, FEATURES_TEMPLATE])
def test_renders_exactly_as_transformers(default_model_folder, template):
    """Text for text, and an error where transformers fails too (the model's own template reads
    `content`, which a tool-calling turn without text does not have)."""
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    source = tokenizer.get_chat_template() if template == "model" else template
    cases = [(messages, tools, generation) for messages in CONVERSATIONS
             for tools in (None, TOOLS) for generation in (True, False)]

    async def render_all(pool):
        rendered = []
        for messages, tools, generation in cases:
            try:
                rendered.append(await pool.render(source, messages, tools, generation))
            except APIError as error:
                assert error.status_code == 400 and error.param == "messages"
                rendered.append("error")
        return rendered

    def transformers_render(messages, tools, generation):
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, chat_template=source,
                                                 add_generation_prompt=generation, tokenize=False)
        except (TemplateError, TypeError):  # some transformers releases (5.17) let the
            return "error"                  # template's own TypeError through unwrapped
        # (SecurityError is a TemplateError)

    rendered = _run(render_all, special_tokens=dict(tokenizer.special_tokens_map))
    assert rendered == [transformers_render(*case) for case in cases]
    # Negative control: the comparison sees a difference as small as the generation prompt.
    assert rendered[0] != rendered[1]
    if template == "model":
        assert rendered.count("error") == 4  # the tool-calling conversation, both ways
    elif template == TOOLS_TEMPLATE:
        assert "error" not in rendered
        assert "<tools>" in rendered[2] and "<tool_call>" in rendered[8]
    else:  # every feature took part: the break, the aliases, the options, the refusal
        assert rendered[-4:] == ["error"] * 4 and rendered.count("error") == 4
        assert "user: 6" not in rendered[12] and "[short <b>&</b> ✓|short" in rendered[12]
        assert '"turns": 5' in rendered[12] and '"function":{' in rendered[14]


def test_a_template_worker_does_not_load_transformers():
    """A worker renders with jinja2 alone (server/chat_render.py): resident memory near the
    interpreter's. The control: the module the workers used to import costs ~40 MB more."""
    import subprocess
    import sys

    def resident_mb(code: str) -> float:
        # VmRSS, not ru_maxrss: Linux carries the peak across exec from the forking parent.
        probe = (f"{code}\nimport sys\n"
                 "rss = next(l for l in open('/proc/self/status') if l.startswith('VmRSS:'))\n"
                 "print(int(rss.split()[1]) / 1024, 'transformers' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             check=True, timeout=120).stdout.split()
        return float(out[0]), out[1] == "True"

    ours, loaded = resident_mb("import server.template_worker, server.chat_render")
    theirs, _ = resident_mb("import transformers.utils.chat_template_utils")
    assert not loaded and ours < 30
    assert theirs > ours + 25


def test_every_attack_is_stopped_and_the_pool_keeps_serving():
    async def attacks(pool):
        outcomes = {}
        for attack in ("spin", "grow", "flood", "recurse", "refuse"):
            started = time.monotonic()
            with pytest.raises((TemplateLimitError, APIError)) as caught:
                await pool.render(HOSTILE_TEMPLATE, [{"role": "user", "content": attack}], None,
                                  True)
            outcomes[attack] = (caught.value, time.monotonic() - started)
            plain = await pool.render(HOSTILE_TEMPLATE, [{"role": "user", "content": "hi"}],
                                      None, True)
            assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        return outcomes

    outcomes = _run(attacks)
    spin, spin_seconds = outcomes["spin"]
    assert isinstance(spin, TemplateLimitError) and "longer than 2 s" in str(spin)
    assert 2.0 <= spin_seconds < 10.0
    assert isinstance(outcomes["grow"][0], TemplateLimitError)
    assert "memory limit" in str(outcomes["grow"][0])
    assert isinstance(outcomes["flood"][0], TemplateLimitError)
    assert "100000" in str(outcomes["flood"][0]) and "--chat-template-max-bytes" in str(
        outcomes["flood"][0])
    for attack in ("recurse", "refuse"):
        assert isinstance(outcomes[attack][0], APIError) and outcomes[attack][0].status_code == 400
    assert "roles must alternate" in outcomes["refuse"][0].message


def test_a_spinning_template_blocks_no_other_request_and_is_seen_as_saturation():
    """The plain rendering is served by a second renderer started on demand: within a Python
    start, not the ~1 ms of an idle renderer."""
    limits = TemplateLimits(timeout_s=4.0, workers=2)

    async def spin_and_serve(pool):
        spin = [{"role": "user", "content": "spin"}]
        first = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, spin, None, True))
        await asyncio.sleep(0.2)
        assert not pool.saturated  # one renderer spins, the other is free
        started = time.monotonic()
        plain = await pool.render(HOSTILE_TEMPLATE, [{"role": "user", "content": "hi"}], None,
                                  True)
        served_in = time.monotonic() - started
        second = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, spin, None, True))
        third = asyncio.create_task(pool.render(HOSTILE_TEMPLATE, spin, None, True))
        await asyncio.sleep(0.2)
        saturated_while_spinning = pool.saturated  # both spin, the third waits
        results = await asyncio.gather(first, second, third, return_exceptions=True)
        return plain, served_in, saturated_while_spinning, results, pool.saturated

    plain, served_in, saturated, results, saturated_after = _run(spin_and_serve, limits)
    assert plain.startswith("<|im_start|>user\nhi") and served_in < limits.timeout_s / 2
    assert saturated and not saturated_after
    assert all(isinstance(result, TemplateLimitError) for result in results)


def test_a_cancelled_rendering_does_not_leave_a_reply_in_the_pipe():
    """A caller cancelled mid-rendering (its client left) must not leave the renderer's late
    reply to be read as the next caller's answer: the renderer is replaced."""
    async def cancel_then_render(pool):
        task = asyncio.create_task(pool.render(
            HOSTILE_TEMPLATE, [{"role": "user", "content": "flood"}], None, True))
        await asyncio.sleep(0.05)
        task.cancel()
        answers = [await pool.render(HOSTILE_TEMPLATE, [{"role": "user", "content": str(i)}],
                                     None, False) for i in range(4)]
        return answers

    answers = _run(cancel_then_render, TemplateLimits(timeout_s=5.0, workers=1))
    assert answers == [f"<|im_start|>user\n{i}<|im_end|>\n" for i in range(4)]
