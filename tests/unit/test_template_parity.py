"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them.

Each case renders one template and one conversation twice: with kvserve's serving path
(:func:`kvserve.chat.prompt.render_chat`: message validation, tool-call arguments, content
parts, continuing the final message, then :class:`~kvserve.chat.template.ChatTemplate`) and
with transformers (a ``PreTrainedTokenizerFast`` built in memory from a three-token
``tokenizers`` vocabulary, no hub: ``apply_chat_template(..., tokenize=False)``), and asserts
equal text. transformers is a test-only dependency (pyproject's ``test`` extra); kvserve never
imports it.

transformers is given the messages as vLLM gives them to it: an assistant's tool-call
``arguments`` sent as a JSON string (what OpenAI clients send) is parsed into the object it
encodes (vLLM's ``_postprocess_messages``, llama.cpp likewise), and text content parts are
joined with newlines (vLLM's ``string`` content format). ``strftime_now`` is frozen to one
instant in both renderers.

Templates: small ones written here, one per feature (``strftime_now``, ``raise_exception``,
loop controls, ``namespace``, ``dict``, ``tojson`` options, trim/lstrip blocks, tools,
documents, generation prompt, extra kwargs, null members, reasoning fields, ``{% generation %}``),
the SmolLM2 GGUF's embedded template, and the vendors' HF templates in tests/templates/vendor/
(copied from llama.cpp's models/templates/, which its scripts/get_chat_template.py fetched from
each model's tokenizer_config.json on the Hub).
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
from pathlib import Path

import pytest

import transformers.utils.chat_template_utils as hf_ctu
from kvserve.chat import template as kv_template
from kvserve.chat.prompt import merge_system_message, render_chat
from kvserve.chat.template import ChatTemplate, TemplateError
from kvserve.errors import InvalidInputError
from kvserve.loaders.tokenizer import Tokenizer, read_gguf_metadata

VENDOR = Path(__file__).parents[1] / "templates" / "vendor"
FROZEN = _dt.datetime(2026, 3, 9, 14, 5, 7)


class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: D102 - test clock
        return FROZEN if tz is None else FROZEN.replace(tzinfo=tz)


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch):
    """Both renderers' ``strftime_now`` read ``datetime.now()`` from their module's global."""
    monkeypatch.setattr(kv_template, "datetime", _FrozenDatetime)
    monkeypatch.setattr(hf_ctu, "datetime", _FrozenDatetime)


@pytest.fixture(scope="module")
def kv_tok(smollm2_gguf) -> Tokenizer:
    """Any kvserve tokenizer will do: only the rendered text is compared."""
    return Tokenizer.from_gguf_file(smollm2_gguf)


_HF_TOKS: dict = {}


def _hf_tokenizer(bos: str, eos: str):
    """A transformers fast tokenizer with just these special tokens (no files, no hub)."""
    key = (bos, eos)
    if key not in _HF_TOKS:
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import models
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, bos: 1, eos: 2}
        raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        _HF_TOKS[key] = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos)
    return _HF_TOKS[key]


def _as_vllm_gives(messages: list[dict], parse_arguments: bool = True, join_parts: bool = True) -> list[dict]:
    """Messages as vLLM hands them to transformers: tool-call arguments strings parsed into
    objects (unless ``parse_arguments`` is False), text parts joined with newlines (unless
    ``join_parts`` is False: a template that loops over content), a null content as ``""``."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        elif isinstance(m.get("content"), list) and join_parts:
            m["content"] = "\n".join(p["text"] for p in m["content"])
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str) and parse_arguments:
                call["function"]["arguments"] = json.loads(args) if args else {}
            elif args is None:
                call["function"]["arguments"] = {}
    return out


def hf_render(source: str, messages: list[dict], *, bos: str = "<s>", eos: str = "</s>", tools=None,
              documents=None, add_generation_prompt: bool = True, continue_final_message: bool = False,
              parse_arguments: bool = True, join_parts: bool = True, **kwargs) -> str:
    """transformers' text for this template and conversation."""
    tok = _hf_tokenizer(bos, eos)
    return tok.apply_chat_template(_as_vllm_gives(messages, parse_arguments, join_parts), chat_template=source, tools=copy.deepcopy(tools),
                                   documents=copy.deepcopy(documents),
                                   add_generation_prompt=add_generation_prompt and not continue_final_message,
                                   continue_final_message=continue_final_message, tokenize=False, **kwargs)


def kv_render(tok: Tokenizer, source: str, messages: list[dict], *, bos: str = "<s>", eos: str = "</s>",
              tools=None, documents=None, add_generation_prompt: bool = True,
              continue_final_message: bool = False, template_cls: type = ChatTemplate, **kwargs) -> str:
    """kvserve's text: the path a chat request takes (render_chat)."""
    if documents is not None:
        kwargs["documents"] = copy.deepcopy(documents)
    text, _ = render_chat(template_cls(source, bos_token=bos, eos_token=eos), tok, copy.deepcopy(messages),
                          add_generation_prompt=add_generation_prompt, tools=copy.deepcopy(tools),
                          continue_final_message=continue_final_message, **kwargs)
    return text


def assert_parity(tok: Tokenizer, source: str, messages: list[dict], *, join_parts: bool = True, **kw) -> str:
    want = hf_render(source, messages, join_parts=join_parts, **kw)
    got = kv_render(tok, source, messages, **kw)
    assert got == want
    return got


# -- conversations --------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city. Température <b>°C</b>.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"}},
    "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "Query"}},
                   "required": ["q"]}}}
TOOLS = [WEATHER, SEARCH]
DOCS = [{"title": "Tides", "text": "High tide at 06:12 and 18:40."},
        {"title": "Moon", "text": "The moon is waxing <gibbous> — 82% lit."}]

SYS = {"role": "system", "content": "You are terse. Ünïcode ok."}
U1 = {"role": "user", "content": "Hello there!"}
A1 = {"role": "assistant", "content": "Hi. What do you need?"}
U2 = {"role": "user", "content": "  What's the weather in Zürich?\n"}
CALL_STR = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'}}]}
CALL_OBJ = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
          "content": '{"temp": 7, "sky": "overcast"}'}
A_FINAL = {"role": "assistant", "content": "7 °C and overcast."}
THINK_A = {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 is 4, simple."}
PARTIAL = {"role": "assistant", "content": "The answer is"}

CONVS = {
    "user": [U1],
    "system_multi_turn": [SYS, U1, A1, U2],
    "no_system_multi_turn": [U1, A1, U2],
    "tool_call_and_result": [SYS, U2, CALL_STR, RESULT],
    "tool_round_trip": [U2, CALL_STR, RESULT, A_FINAL, {"role": "user", "content": "Thanks"}],
    "thinking_history": [U1, THINK_A, U2],
    "continue_final": [SYS, U1, PARTIAL],
}


# -- templates written here, one per feature -------------------------------------------------

FEATURES = {
    "strftime_now": (
        "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%A %H:%M:%S') }}\n"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"),
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ loop.index }}/{{ loop.length }} {{ m.role }}{% if loop.first %} first{% endif %}"
        "{% if loop.last %} last{% endif %}: {{ m.content | trim }}\n"
        "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
    "namespace_and_dict": (
        "{% set ns = namespace(count=0, roles=[], last_user=-1) %}"
        "{% for m in messages %}{% set ns.count = ns.count + 1 %}{% set ns.roles = ns.roles + [m.role] %}"
        "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{{ ns.count }} {{ ns.roles | join(',') }} {{ ns.last_user }}\n"
        "{% set d = dict(a=1, b=[2, 3]) %}{{ d | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}\n"
        "{{ messages | map(attribute='role') | unique | list | tojson }}"),
    "tojson_options": (
        "{{ tools | tojson }}\n{{ tools[0] | tojson(indent=2) }}\n{{ tools[0] | tojson(indent=4, sort_keys=true) }}\n"
        "{{ tools[0].function | tojson(ensure_ascii=true) }}\n"
        "{{ tools[0].function.parameters | tojson(separators=(',', ':')) }}\n"
        "{{ messages | tojson }}\n{{ 'a <b> & \"c\" é' | tojson }}"),
    "trim_and_lstrip_blocks": (
        "<start>\n"
        "    {% for m in messages %}\n"
        "    [{{ m.role }}]\n"
        "        {% if m.content %}\n"
        "{{ m.content }}\n"
        "        {% endif %}\n"
        "    {% endfor %}\n"
        "  {%+ if add_generation_prompt %}  keep  {% endif +%}\n"
        "{%- if true -%}   tight   {%- endif -%}\n"
        "<end>\n"),
    "tools_and_calls": (
        "{% if tools %}Tools:{% for t in tools %}\n- {{ t.function.name }}({{ t.function.parameters.properties"
        " | list | join(', ') }}): {{ t.function.description }}{% endfor %}\n{% endif %}"
        "{% for m in messages %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
        "CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}"
        " mapping={{ c.function.arguments is mapping }} city={{ c.function.arguments.city }}\n{% endfor %}"
        "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.name }}: {{ m.content }}\n"
        "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"),
    "documents": (
        "{% if documents %}{% for d in documents %}<doc id={{ loop.index0 }} title={{ d.title | tojson }}>"
        "{{ d.text }}</doc>\n{% endfor %}{% else %}no documents\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"),
    "kwargs_and_special_tokens": (
        "{{ bos_token }}{% if enable_thinking is defined %}thinking={{ enable_thinking }}"
        "{% else %}thinking undefined{% endif %} effort={{ reasoning_effort | default('none') }}"
        " custom={{ custom_var | default('unset') | tojson }}\n"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
        " <think></think>{% endif %}{% endif %}"),
    "null_members_and_content_tests": (
        "{% for m in messages %}{{ m.role }} defined={{ m.content is defined }} none={{ m.content is none }}"
        " string={{ m.content is string }} in={{ 'content' in m }} calls={{ 'tool_calls' in m }}"
        " keys={{ m | list | join(',') }}\n{% endfor %}"),
    "reasoning_fields": (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.reasoning_content is defined %} [rc={{ m.reasoning_content }}]{% endif %}"
        "{% if m.thinking is defined %} [th={{ m.thinking }}]{% endif %}\n{% endfor %}"),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}\n"
        "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"),
    "continue_trimmed_content": (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
}


@pytest.mark.parametrize(("feature", "conv"), [
    (f, c) for f in sorted(FEATURES) for c in sorted(CONVS)
    # continuing needs a template that writes message content (transformers refuses otherwise)
    if not (c == "continue_final" and f in ("namespace_and_dict", "null_members_and_content_tests", "tojson_options"))])
def test_feature_templates(kv_tok, feature: str, conv: str) -> None:
    msgs = CONVS[conv]
    kw: dict = {"tools": TOOLS} if "tool" in conv or feature in ("tools_and_calls", "tojson_options") else {}
    if feature == "documents":
        kw["documents"] = DOCS
    if feature == "kwargs_and_special_tokens":
        kw.update(enable_thinking=False, custom_var={"k": ["é", 1]})
    if conv == "continue_final":
        kw["continue_final_message"] = True
    assert_parity(kv_tok, FEATURES[feature], msgs, **kw)


def test_strftime_now_is_the_frozen_day(kv_tok) -> None:
    assert kv_render(kv_tok, FEATURES["strftime_now"], [U1]).split("\n")[0] == "2026-03-09|09 Mar 2026|Monday 14:05:07"


def test_kwargs_undefined_and_true(kv_tok) -> None:
    src = FEATURES["kwargs_and_special_tokens"]
    assert assert_parity(kv_tok, src, [U1]).startswith("<s>thinking undefined effort=none custom=\"unset\"\n")
    assert assert_parity(kv_tok, src, [U1], enable_thinking=True, reasoning_effort="high",
                         bos="<|begin|>", eos="<|eot|>") == (
        "<|begin|>thinking=True effort=high custom=\"unset\"\nuser: Hello there!<|eot|>\nassistant:")


def test_tool_call_arguments_string_or_object(kv_tok) -> None:
    """OpenAI clients send arguments as a JSON string, transformers users as a dict: the
    template sees the object either way (vLLM parses the string for the template too)."""
    src = FEATURES["tools_and_calls"]
    by_str = assert_parity(kv_tok, src, CONVS["tool_call_and_result"], tools=TOOLS)
    obj_conv = [SYS, U2, CALL_OBJ, RESULT]
    assert kv_render(kv_tok, src, obj_conv, tools=TOOLS) == by_str == hf_render(src, obj_conv, tools=TOOLS)
    assert 'CALL call12345 get_weather {"city": "Zürich", "unit": "celsius"} mapping=True city=Zürich\n' in by_str


def test_null_members(kv_tok) -> None:
    """A null content is ``""`` (vLLM's string format); other null members are dropped, as
    transformers drops them."""
    msgs = [{**U2, "name": None}, CALL_STR, RESULT]
    out = assert_parity(kv_tok, FEATURES["null_members_and_content_tests"], msgs, add_generation_prompt=False)
    assert out.split("\n")[:2] == [
        "user defined=True none=False string=True in=True calls=False keys=role,content",
        "assistant defined=True none=False string=True in=True calls=True keys=role,content,tool_calls"]
    # the template layer alone: what transformers renders for the same dicts
    tmpl = ChatTemplate(FEATURES["null_members_and_content_tests"])
    raw = [{"role": "assistant", "content": None, "tool_calls": [], "name": None}]
    assert tmpl.render(raw, add_generation_prompt=False) == _hf_tokenizer("<s>", "</s>").apply_chat_template(
        raw, chat_template=tmpl.source, tokenize=False) == (
        "assistant defined=False none=False string=False in=False calls=True keys=role,tool_calls\n")


def test_reasoning_aliases(kv_tok) -> None:
    src = FEATURES["reasoning_fields"]
    for field in ("reasoning_content", "thinking", "reasoning"):
        msgs = [U1, {"role": "assistant", "content": "4", field: "2+2"}]
        assert assert_parity(kv_tok, src, msgs) == "user: Hello there!assistant: 4 [rc=2+2] [th=2+2]"


PARTS_USER = {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}
LOOPS_OVER_CONTENT = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for part in m.content %}[{{ part.text }}]{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}")


def test_content_parts_join_for_string_templates(kv_tok) -> None:
    """A template that does not loop over content gets text parts joined with newlines
    (vLLM's string format; transformers would fail concatenating a list)."""
    for src in (FEATURES["reasoning_fields"], _vendor("Qwen-Qwen2.5-7B-Instruct")):
        assert ChatTemplate(src).content_format == "string"
        assert "first\nsecond" in assert_parity(kv_tok, src, [PARTS_USER])


def test_content_parts_kept_for_templates_that_loop_over_content(kv_tok) -> None:
    """A template that loops over content (vLLM's auto: openai) gets the parts as sent;
    string contents stay strings, as transformers passes what it is given."""
    msgs = [SYS, PARTS_USER, A1, {"role": "user", "content": [{"type": "text", "text": "only"}]}]
    assert ChatTemplate(LOOPS_OVER_CONTENT).content_format == "openai"
    assert assert_parity(kv_tok, LOOPS_OVER_CONTENT, msgs, join_parts=False) == (
        "system:You are terse. Ünïcode ok.\nuser:[first][second]\nassistant:Hi. What do you need?\nuser:[only]\n")
    mistral = _vendor("Mistral-Small-3.2-24B-Instruct-2506")
    assert assert_parity(kv_tok, mistral, [SYS, PARTS_USER, A1, PARTS_USER], bos="<s>", eos="</s>",
                         join_parts=False).endswith("[INST]firstsecond[/INST]")
    # continuing a final message given as parts continues its last text part (transformers)
    partial = {"role": "assistant", "content": [{"type": "text", "text": "The"}, {"type": "text", "text": " answer"}]}
    assert assert_parity(kv_tok, LOOPS_OVER_CONTENT, [PARTS_USER, partial], join_parts=False,
                         continue_final_message=True) == "user:[first][second]\nassistant:[The][ answer"


def test_content_format_flag_overrides_detection(kv_tok) -> None:
    """``--chat-template-content-format string`` joins the parts even for a template that
    loops over content; ``openai`` gives parts to any template."""
    from kvserve.chat.builtin_templates import with_content_format

    joined = kv_render(kv_tok, LOOPS_OVER_CONTENT, [PARTS_USER], template_cls=with_content_format(ChatTemplate, "string"))
    assert joined == hf_render(LOOPS_OVER_CONTENT, [PARTS_USER]) == "user:first\nsecond\n"
    as_parts = kv_render(kv_tok, LOOPS_OVER_CONTENT, [U1, PARTS_USER],
                         template_cls=with_content_format(ChatTemplate, "openai"))
    assert as_parts == "user:[Hello there!]\nuser:[first][second]\n"


def test_content_format_detection_of_vendor_templates() -> None:
    got = {name for name in VENDORS if ChatTemplate(_vendor(name)).content_format == "openai"}
    assert got == {"Mistral-Small-3.2-24B-Instruct-2506", "moonshotai-Kimi-K2"}


def test_continue_final_message_with_trimmed_content(kv_tok) -> None:
    src = FEATURES["continue_trimmed_content"]
    msgs = [U1, {"role": "assistant", "content": "The answer is "}]
    assert assert_parity(kv_tok, src, msgs, continue_final_message=True) == (
        "<|user|>Hello there!<|end|>\n<|assistant|>The answer is")


# -- errors: both refuse, kvserve with the template's own message ---------------------------

def test_raise_exception(kv_tok) -> None:
    src = ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user, got '"
           " + messages[0].role) }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert assert_parity(kv_tok, src, [U1, A1]) == "Hello there!Hi. What do you need?"
    with pytest.raises(Exception) as hf_err:
        hf_render(src, [SYS, U1])
    assert str(hf_err.value) == "Conversation must start with user, got system"
    # llama-server's workaround for a template without the system role (kvserve follows it; vLLM
    # answers transformers' error): the system text goes before the first user message's
    assert kv_render(kv_tok, src, [SYS, U1]) == SYS["content"] + "\n" + U1["content"]
    with pytest.raises(InvalidInputError) as kv_err:
        kv_render(kv_tok, src, [A1, U1])
    assert kv_err.value.message == "chat template error: Conversation must start with user, got assistant"


def test_underscore_namespace_names_refused(kv_tok) -> None:
    for src in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace(x=1) %}{% set ns._y = 2 %}x"):
        with pytest.raises(Exception, match="underscore-prefixed"):
            hf_render(src, [U1])
        with pytest.raises(InvalidInputError, match="SecurityError: Chat templates cannot store underscore-prefixed"):
            kv_render(kv_tok, src, [U1])


def test_do_extension_is_not_enabled() -> None:
    """transformers enables loopcontrols only: ``{% do %}`` is a syntax error in both."""
    src = "{% set xs = [] %}{% do xs.append(1) %}{{ xs }}"
    with pytest.raises(Exception, match="do"):
        hf_ctu._compile_jinja_template(src)
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate(src)


# -- the SmolLM2 GGUF's embedded template ----------------------------------------------------

@pytest.mark.parametrize("conv", sorted(CONVS))
def test_smollm2_gguf_template(kv_tok, smollm2_gguf, conv: str) -> None:
    src = read_gguf_metadata(smollm2_gguf)["tokenizer.chat_template"]
    kw = {"continue_final_message": True} if conv == "continue_final" else {}
    assert_parity(kv_tok, src, CONVS[conv], bos="<|im_start|>", eos="<|im_end|>", **kw)


# -- the vendors' templates ------------------------------------------------------------------

#: file -> (bos_token, eos_token) as the model's tokenizer_config.json has them
VENDORS = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("", "<|im_end|>"),
    "Qwen-QwQ-32B": ("", "<|im_end|>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("<|end_of_text|>", "<|end_of_text|>"),
    "fireworks-ai-llama-3-firefunction-v2": ("<|begin_of_text|>", "<|eot_id|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "moonshotai-Kimi-K2": ("[BOS]", "[EOS]"),
    "openai-gpt-oss-120b": ("<|startoftext|>", "<|return|>"),
}

#: templates written for tools only (a tokenizer's ``tool_use`` template, which transformers picks
#: when tools are given): rendered with the tools in every conversation
TOOL_USE = {"CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"}

#: the variables a vendor's template needs from the caller (its model card's example)
VENDOR_KW = {
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps([t["function"] for t in TOOLS], indent=4), "datetime": "2026-03-09"},
}

#: (template, conversation) pairs where the vendor's template itself refuses the conversation
#: (``raise_exception`` or a Jinja error) in transformers: kvserve must refuse them too (400).
VENDOR_REFUSES: dict[tuple[str, str], str] = {
    # Gemma 2 has no system role, and wants user/assistant turns strictly alternating
    ("google-gemma-2-2b-it", "continue_final"): "TemplateError: System role not supported",
    ("google-gemma-2-2b-it", "system_multi_turn"): "TemplateError: System role not supported",
    ("google-gemma-2-2b-it", "tool_call_and_result"): "TemplateError: System role not supported",
    ("google-gemma-2-2b-it", "tool_round_trip"):
        "TemplateError: Conversation roles must alternate user/assistant/user/assistant/...",
}

#: (template, conversation) pairs whose template concatenates tool-call arguments as text: given
#: objects (as vLLM gives them) transformers fails; kvserve then renders the client's JSON
#: strings as sent, which is what transformers renders when given those strings
STRING_ARGUMENTS = {("deepseek-ai-DeepSeek-V3.1", "tool_call_and_result"),
                    ("deepseek-ai-DeepSeek-V3.1", "tool_round_trip"),
                    ("fireworks-ai-llama-3-firefunction-v2", "tool_call_and_result"),
                    ("fireworks-ai-llama-3-firefunction-v2", "tool_round_trip")}

#: per-conversation extra arguments (the tools go with the tool conversations)
CONV_KW = {
    "tool_call_and_result": {"tools": TOOLS},
    "tool_round_trip": {"tools": TOOLS},
    "continue_final": {"continue_final_message": True},
}


def _vendor(name: str) -> str:
    return (VENDOR / f"{name}.jinja").read_text(encoding="utf-8")


def _merged_render_ok(src: str, msgs: list[dict], bos: str, eos: str, kw: dict) -> bool:
    """Whether kvserve renders a conversation the template refused, as llama-server does: it starts
    with a system message, the template lacks the system role, and renders once it is merged."""
    if msgs[0]["role"] != "system" or ChatTemplate(src, bos_token=bos, eos_token=eos).caps["supports_system_role"]:
        return False
    try:
        hf_render(src, merge_system_message(copy.deepcopy(msgs)), bos=bos, eos=eos, **kw)
    except Exception:
        return False
    return True


def _vendor_case(kv_tok, name: str, conv: str, **kw) -> None:
    bos, eos = VENDORS[name]
    src = _vendor(name)
    kw = {**CONV_KW.get(conv, {}), **VENDOR_KW.get(name, {}), **kw}
    if name in TOOL_USE:
        kw.setdefault("tools", TOOLS)
    try:
        want = hf_render(src, CONVS[conv], bos=bos, eos=eos, **kw)
    except TypeError as e:
        assert (name, conv) in STRING_ARGUMENTS, e
        assert str(e) == 'can only concatenate str (not "dict") to str'
        want = hf_render(src, CONVS[conv], bos=bos, eos=eos, parse_arguments=False, **kw)
        assert kv_render(kv_tok, src, CONVS[conv], bos=bos, eos=eos, **kw) == want
        # given objects, kvserve cannot make strings up: it refuses as transformers does
        with pytest.raises(InvalidInputError, match="can only concatenate str"):
            kv_render(kv_tok, src, [{**m, "tool_calls": CALL_OBJ["tool_calls"]} if "tool_calls" in m else m
                                    for m in CONVS[conv]], bos=bos, eos=eos, **kw)
        return
    except Exception as e:  # the template refuses this conversation
        assert VENDOR_REFUSES.get((name, conv)) == f"{type(e).__name__}: {e}"
        if _merged_render_ok(src, CONVS[conv], bos, eos, kw):  # llama-server's system-role workaround
            want = hf_render(src, merge_system_message(copy.deepcopy(CONVS[conv])), bos=bos, eos=eos, **kw)
            assert kv_render(kv_tok, src, CONVS[conv], bos=bos, eos=eos, **kw) == want
            return
        with pytest.raises(InvalidInputError):
            kv_render(kv_tok, src, CONVS[conv], bos=bos, eos=eos, **kw)
        return
    assert (name, conv) not in VENDOR_REFUSES and (name, conv) not in STRING_ARGUMENTS
    assert kv_render(kv_tok, src, CONVS[conv], bos=bos, eos=eos, **kw) == want


@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("name", sorted(VENDORS))
def test_vendor_templates(kv_tok, name: str, conv: str) -> None:
    _vendor_case(kv_tok, name, conv)


@pytest.mark.parametrize(("name", "kw"), [
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}),
    ("Qwen-Qwen3-0.6B", {"enable_thinking": True}),
    ("deepseek-ai-DeepSeek-V3.1", {"thinking": True}),
    ("deepseek-ai-DeepSeek-V3.1", {"thinking": False}),
    ("ibm-granite-granite-3.3-2B-Instruct", {"thinking": True}),
    ("openai-gpt-oss-120b", {"reasoning_effort": "high"}),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", {"enable_citations": True}),
    ("meta-llama-Llama-3.1-8B-Instruct", {"tools_in_user_message": False, "date_string": "1 Jan 2026"}),
])
@pytest.mark.parametrize("conv", ["system_multi_turn", "thinking_history", "tool_round_trip"])
def test_vendor_template_kwargs(kv_tok, name: str, kw: dict, conv: str) -> None:
    _vendor_case(kv_tok, name, conv, **kw)


@pytest.mark.parametrize("name", ["ibm-granite-granite-3.3-2B-Instruct",
                                  "CohereForAI-c4ai-command-r7b-12-2024-tool_use"])
@pytest.mark.parametrize("conv", ["user", "system_multi_turn"])
def test_vendor_templates_with_documents(kv_tok, name: str, conv: str) -> None:
    _vendor_case(kv_tok, name, conv, documents=DOCS)


def test_kvserve_never_imports_transformers() -> None:
    """transformers is the reference here, not a dependency: no kvserve module imports it."""
    import ast

    root = Path(__file__).parents[2] / "kvserve"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert found == []


def test_request_documents_field(kv_tok) -> None:
    """A chat request's ``documents`` (vLLM's field) reach the template; ``chat_template_kwargs``
    may set them too and wins, as vLLM merges them; a bad value is a 400 naming the field."""
    from types import SimpleNamespace

    from kvserve.faces.chat_features import template_kwargs
    from kvserve.faces.api_error import ApiError

    args = SimpleNamespace(chat_template_kwargs={}, reasoning=None)
    kw = template_kwargs(args, {"documents": DOCS})
    assert kw == {"documents": DOCS}
    src = FEATURES["documents"]
    assert kv_render(kv_tok, src, [U1], **kw) == hf_render(src, [U1], documents=DOCS) == (
        '<doc id=0 title="Tides">High tide at 06:12 and 18:40.</doc>\n'
        '<doc id=1 title="Moon">The moon is waxing <gibbous> — 82% lit.</doc>\nuser: Hello there!\n')
    other = [{"title": "T", "text": "x"}]
    assert template_kwargs(args, {"documents": DOCS, "chat_template_kwargs": {"documents": other}}) == {
        "documents": other}
    with pytest.raises(ApiError) as e:
        template_kwargs(args, {"documents": {"title": "T"}})
    assert (e.value.status, e.value.message) == (400, "Field 'documents': type must be array, but is object")
    with pytest.raises(ApiError) as e:
        template_kwargs(args, {"documents": [{"title": "T"}, "text"]})
    assert (e.value.status, e.value.message) == (400, "Field 'documents[1]': type must be object, but is string")
