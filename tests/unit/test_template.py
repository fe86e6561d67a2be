"""ChatTemplate: SmolLM2's GGUF template vs llama-server prompts, errors, tools, caps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.chat.template import CHATML_TEMPLATE, ChatTemplate, TemplateError
from kvserve.loaders.tokenizer import read_gguf_metadata

REF = Path(__file__).parents[1] / "reference" / "smollm2"
ROWS = [json.loads(line) for line in (REF / "templates.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]

HERMES = """\
{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}
# Tools

<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message['role'] == 'system' %}
{% elif message['role'] == 'assistant' and message.tool_calls %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message['role'] == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@pytest.fixture(scope="module")
def smol_template(smollm2_gguf) -> ChatTemplate:
    src = read_gguf_metadata(smollm2_gguf)["tokenizer.chat_template"]
    return ChatTemplate(src, bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.mark.parametrize("row", ROWS)
def test_smollm2_reference_prompts(smol_template: ChatTemplate, row: dict) -> None:
    assert smol_template.render(row["messages"], add_generation_prompt=True) == row["prompt"]


def test_smollm2_no_generation_prompt(smol_template: ChatTemplate) -> None:
    out = smol_template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                               add_generation_prompt=False)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


def test_smollm2_caps(smol_template: ChatTemplate) -> None:
    caps = smol_template.caps
    assert caps["supports_system_role"] is True
    assert caps["supports_tools"] is False
    assert caps["supports_tool_calls"] is False
    assert caps["supports_parallel_tool_calls"] is False


def test_raise_exception() -> None:
    t = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                     "{% endif %}{{ messages[0]['content'] }}")
    assert t.render([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(TemplateError, match="System role not supported"):
        t.render([{"role": "system", "content": "x"}])
    assert t.caps["supports_system_role"] is False


def test_jinja_errors() -> None:
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")
    t = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "hi"}])
    # immutable sandbox: templates cannot mutate their inputs
    t = ChatTemplate("{% set x = messages.append(1) %}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "hi"}])


def test_hermes_tool_calls() -> None:
    t = ChatTemplate(HERMES)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Show pom.xml"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "pom.xml"}}},
            {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.ß"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "<project/>"},
    ]
    out = t.render(messages, tools=[TOOL])
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n"
        '{"type": "function", "function": {"name": "read_file", "description": "Read a file.", '
        '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\nShow pom.xml<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "pom.xml"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.ß"}}\n</tool_call>\n'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n<project/>\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    caps = t.caps
    assert caps["supports_tools"] and caps["supports_tool_calls"] and caps["supports_parallel_tool_calls"]
    assert caps["supports_system_role"] and caps["supports_tool_responses"]
    assert caps["requires_object_arguments"] is False


def test_tojson_hf_compatible() -> None:
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    out = t.render([], x={"a": "<é>", "b": [1]})
    assert out == '{"a": "<é>", "b": [1]}|{\n  "a": "<é>",\n  "b": [\n    1\n  ]\n}'


def test_kwargs_bos_strftime_generation_tag() -> None:
    t = ChatTemplate("{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
                     "{% generation %}[{{ strftime_now('%Y') | length }}]{% endgeneration %}{{ eos_token }}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render([], enable_thinking=False) == "<s>/no_think[4]</s>"
    assert t.render([]) == "<s>[4]</s>"


def test_trim_and_lstrip_blocks() -> None:
    t = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_chatml_fallback() -> None:
    t = ChatTemplate(CHATML_TEMPLATE)
    out = t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                   add_generation_prompt=False)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    assert t.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    assert t.caps["supports_system_role"] and not t.caps["supports_tools"]
