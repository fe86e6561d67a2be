"""Chat template rendering is bounded (kvserve's own limits): loop steps, built sizes, recursion and
memory end in a TemplateError (a 400), never a hang or a 10 GB allocation."""

from __future__ import annotations

import time

import pytest

from kvserve.chat import template as template_mod
from kvserve.chat.template import MAX_RENDER_CHARS, ChatTemplate, TemplateError

USER = [{"role": "user", "content": "hi"}]
LIMIT = "chat template error: the template went over kvserve's rendering limits: "
BIG = f"it built a value of 10000000000 characters or items (the limit is {MAX_RENDER_CHARS})"


@pytest.mark.parametrize("source,message", [
    ("{{ 'x' * 10000000000 }}", LIMIT + BIG),
    ("{{ 10000000000 * ['x'] }}", LIMIT + BIG),
    ("{{ 'x'|center(10000000000) }}", LIMIT + BIG),
    ("{{ 'x'.rjust(10000000000) }}", LIMIT + BIG),
    ("{{ range(100000)|join('x' * 100000) }}", LIMIT + BIG),
    ("{{ 'ab'|replace('', 'x' * 10000000) }}", LIMIT + "it built a value of 30000002 characters or items "
     f"(the limit is {MAX_RENDER_CHARS})"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     LIMIT + f"it built a value of 33554432 characters or items (the limit is {MAX_RENDER_CHARS})"),
    ("{{ '%10000000000s' % 'x' }}", LIMIT + "its format string asks for a width of a million characters or more"),
    ("{{ 2 ** 10000000000 }}", LIMIT + f"it built an integer of about 20000000000 bits (the limit is {MAX_RENDER_CHARS})"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
     "chat template error: recursion too deep (a macro or recursive loop that calls itself without end, "
     "or data nested too deeply)"),
    ("{{ range(1000000)|list }}", "chat template error: OverflowError: Range too big. The sandbox blocks ranges "
     "larger than MAX_RANGE (100000)."),
])
def test_unbounded_templates_are_template_errors(source, message):
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render(USER)
    assert str(e.value) == message


def test_nested_loops_stop_at_the_step_budget(monkeypatch):
    monkeypatch.setattr(template_mod, "MAX_RENDER_STEPS", 50_000)
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    t0 = time.monotonic()
    with pytest.raises(TemplateError) as e:
        ChatTemplate(src).render(USER)
    assert str(e.value) == LIMIT + "it took too many steps (loop iterations, calls)"
    assert time.monotonic() - t0 < 5
    # under the budget the same loops render
    assert ChatTemplate("{% for i in range(200) %}{% for j in range(200) %}{% endfor %}{% endfor %}"
                        "{{ messages[0].content }}").render(USER) == "hi"


def test_the_deadline_stops_a_render(monkeypatch):
    monkeypatch.setattr(template_mod, "MAX_RENDER_SECONDS", 0.0)
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{% for i in range(5000) %}{% endfor %}").render(USER)
    assert str(e.value) == LIMIT + "it took too long"


def test_output_size_is_bounded(monkeypatch):
    monkeypatch.setattr(template_mod, "MAX_RENDER_CHARS", 1000)
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{% for i in range(100) %}{{ 'x' * 20 }}{% endfor %}").render(USER)
    assert str(e.value) == LIMIT + "it built a value of 1020 characters or items (the limit is 1000)"


def test_loops_keep_their_semantics():
    src = ("{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}"
           "{% else %}none{% endfor %}|{% for x in [] %}a{% else %}empty{% endfor %}|{{ 'a' ~ 1 ~ none }}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert ChatTemplate(src).render(msgs) == "1/22/2!|empty|a1None"


def test_capability_probe_of_a_hanging_template_is_quick():
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}")
    t0 = time.monotonic()
    assert not any(t.caps.values())
    assert time.monotonic() - t0 < 2


def test_deeply_nested_tool_call_arguments_object_is_a_template_error():
    # arguments given as an object (not a string) reach tojson as is: 3000 levels -> RecursionError
    args: dict = {}
    cur = args
    for _ in range(3000):
        cur["a"] = {}
        cur = cur["a"]
    t = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
                     "{% endfor %}{% endfor %}")
    with pytest.raises(TemplateError) as e:
        t.render([{"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": args}}]}])
    assert str(e.value) == ("chat template error: recursion too deep (a macro or recursive loop that calls itself "
                            "without end, or data nested too deeply)")
