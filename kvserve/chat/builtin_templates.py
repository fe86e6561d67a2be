"""llama-server's built-in chat template names (``--chat-template chatml``, ``llama3``, ...), each
written as a Jinja template that renders the text llama.cpp's ``llm_chat_apply_template``
writes for that format (``src/llama-chat.cpp``), and the rule that says what a
``--chat-template`` value is (:func:`resolve_chat_template`).

The formats follow llama.cpp's C++ code, not the model vendors' own Jinja templates: where the
two differ (a system message folded into the first user turn, whitespace trimmed, BOS text
left to the tokenizer) the text here is llama-server's. Trimming is C's ``isspace`` set
(space, tab, newline, carriage return, vertical tab, form feed), as llama.cpp's ``trim``.
A message's content may be null (an assistant turn with only tool calls): it renders as "".
"""

from __future__ import annotations

import os

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplateChoiceError", "builtin_names", "resolve_chat_template",
           "with_content_format"]

# Jinja pieces: C's isspace trim, and a message's content as a string
_TRIM = ".strip(' \\t\\n\\r\\x0b\\x0c')"
_C = "(message['content'] or '')"
_CT = f"{_C}{_TRIM}"


def _each(body: str, gen: str = "") -> str:
    """``for message in messages: body`` then ``gen`` when add_generation_prompt."""
    out = "{%- for message in messages -%}" + body + "{%- endfor -%}"
    if gen:
        out += "{%- if add_generation_prompt -%}{{- '" + gen + "' -}}{%- endif -%}"
    return out


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    c = _CT if strip else _C
    sys_part = ("{{- '<<SYS>>\\n' + " + c + " + '\\n<</SYS>>\\n\\n' -}}") if system else ("{{- " + c + " + '\\n' -}}")
    again = "<s>[INST] " if bos_inside else "[INST] "
    return ("{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}"
            "{%- for message in messages -%}"
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '" + again + "' -}}{%- endif -%}"
            "{%- if message['role'] == 'system' -%}" + sys_part +
            "{%- elif message['role'] == 'user' -%}{{- " + c + " + ' [/INST]' -}}"
            "{%- else -%}{{- " + c + " + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
            "{%- endfor -%}")


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> str:
    a = _CT if trim_assistant else _C
    return ("{%- set ns = namespace(inside=false) -%}"
            "{%- for message in messages -%}"
            "{%- if not ns.inside -%}{{- '" + leading + "[INST]" + trailing + "' -}}{%- set ns.inside = true -%}{%- endif -%}"
            "{%- if message['role'] == 'system' -%}{{- " + _C + " + '\\n\\n' -}}"
            "{%- elif message['role'] == 'user' -%}{{- " + _C + " + '" + leading + "[/INST]' -}}"
            "{%- else -%}{{- '" + trailing + "' + " + a + " + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
            "{%- endfor -%}")


def _mistral_v7(sp: str) -> str:
    return _each("{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]" + sp + "' + " + _C + " + '[/SYSTEM_PROMPT]' -}}"
                 "{%- elif message['role'] == 'user' -%}{{- '[INST]" + sp + "' + " + _C + " + '[/INST]' -}}"
                 "{%- else -%}{{- '" + sp + "' + " + _C + " + '</s>' -}}{%- endif -%}")


def _by_role(parts: dict[str, str], gen: str = "", other: str | None = None) -> str:
    """One expression per role (``{role: jinja expression}``); ``other`` for any other role."""
    body, first = "", True
    for role, expr in parts.items():
        body += ("{%- if" if first else "{%- elif") + f" message['role'] == '{role}' -%}}{{{{- {expr} -}}}}"
        first = False
    if other is not None:
        body += "{%- else -%}{{- " + other + " -}}"
    body += "{%- endif -%}"
    return _each(body, gen)


def _vicuna(orca: bool) -> str:
    system = ("'SYSTEM: ' + " + _C + " + '\\n'") if orca else (_C + " + '\\n\\n'")
    return _by_role({"system": system, "user": "'USER: ' + " + _C + " + '\\n'",
                     "assistant": "'ASSISTANT: ' + " + _C + " + '</s>\\n'"}, "ASSISTANT:")


def _exaone(tool: bool) -> str:
    roles = {"system": "'[|system|]' + " + _CT + " + '[|endofturn|]\\n'",
             "user": "'[|user|]' + " + _CT + " + '\\n'",
             "assistant": "'[|assistant|]' + " + _CT + " + '[|endofturn|]\\n'"}
    if tool:
        roles["tool"] = "'[|tool|]' + " + _CT + " + '[|endofturn|]\\n'"
    return _by_role(roles, "[|assistant|]")


_GEMMA = ("{%- set ns = namespace(system='') -%}"
          "{%- for message in messages -%}"
          "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + " + _CT + " -%}"
          "{%- else -%}"
          "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
          "{{- '<start_of_turn>' + role + '\\n' -}}"
          "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          "{{- " + _CT + " + '<end_of_turn>\\n' -}}"
          "{%- endif -%}"
          "{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")

_ORION = ("{%- set ns = namespace(system='') -%}"
          "{%- for message in messages -%}"
          "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + " + _C + " -%}"
          "{%- elif message['role'] == 'user' -%}{{- 'Human: ' -}}"
          "{%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          "{{- " + _C + " + '\\n\\nAssistant: </s>' -}}"
          "{%- else -%}{{- " + _C + " + '</s>' -}}{%- endif -%}"
          "{%- endfor -%}")

_MONARCH = _each("{{- ('' if loop.first else '<s>') + message['role'] + '\\n' + " + _C + " + '</s>\\n' -}}",
                 "<s>assistant\\n")

_OPENCHAT = _by_role({"system": _C + " + '<|end_of_turn|>'"}, "GPT4 Correct Assistant:",
                     other="'GPT4 Correct ' + message['role'][:1]|upper + message['role'][1:] + ': ' + "
                           + _C + " + '<|end_of_turn|>'")

_RWKV = _each("{%- if message['role'] == 'system' -%}{{- 'System: ' + " + _CT + " + '\\n\\n' -}}"
              "{%- elif message['role'] == 'user' -%}{{- 'User: ' + " + _CT + " + '\\n\\n' -}}"
              "{%- if loop.last -%}{{- 'Assistant:' -}}{%- endif -%}"
              "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + " + _CT + " + '\\n\\n' -}}{%- endif -%}")

_GIGACHAT = ("{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
             "{%- if has_system -%}{{- '<s>' + (messages[0]['content'] or '') + '<|message_sep|>' -}}"
             "{%- else -%}{{- '<s>' -}}{%- endif -%}"
             "{%- for message in (messages[1:] if has_system else messages) -%}"
             "{%- if message['role'] == 'user' -%}{{- 'user<|role_sep|>' + " + _C + " + '<|message_sep|>'"
             " + 'available functions<|role_sep|>[]<|message_sep|>' -}}"
             "{%- elif message['role'] == 'assistant' -%}{{- 'assistant<|role_sep|>' + " + _C + " + '<|message_sep|>' -}}"
             "{%- endif -%}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{- 'assistant<|role_sep|>' -}}{%- endif -%}")

_YANDEX = ("<s>" + _by_role({"user": "' Пользователь: ' + " + _C + " + '\\n\\n'",
                              "assistant": "' Ассистент: ' + " + _C + " + '\\n\\n'"})
           + "{%- if add_generation_prompt -%}{{- ' Ассистент:[SEP]' -}}{%- endif -%}")

_BAILING = _each("{{- '<role>' + ('HUMAN' if message['role'] == 'user' else message['role']|upper) + '</role>' + "
                 + _C + " -}}", "<role>ASSISTANT</role>")

_SMOLVLM = "<|im_start|>" + _by_role({"system": _C + " + '\\n\\n'",
                                      "user": "'User: ' + " + _C + " + '<end_of_utterance>\\n'"}, "Assistant:",
                                     other="'Assistant: ' + " + _C + " + '<end_of_utterance>\\n'")

_MINICPM = _by_role({"user": "'<用户>' + " + _CT + " + '<AI>'"}, other=_CT)

#: name -> Jinja source, for every llama-server built-in name kvserve has
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _each("{{- '<|im_start|>' + message['role'] + '\\n' + " + _C + " + '<|im_end|>\\n' -}}",
                    "<|im_start|>assistant\\n"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each("{{- '<|' + message['role'] + '|>\\n' + " + _C + " + '<|end|>\\n' -}}", "<|assistant|>\\n"),
    "phi4": _each("{{- '<|im_start|>' + message['role'] + '<|im_sep|>' + " + _C + " + '<|im_end|>' -}}",
                  "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each("{{- '<|' + message['role'] + '|>\\n' + " + _C + " + '\\n' -}}", "<|assistant|>\\n"),
    "zephyr": _each("{{- '<|' + message['role'] + '|>\\n' + " + _C + " + '<|endoftext|>\\n' -}}", "<|assistant|>\\n"),
    "monarch": _MONARCH,
    "gemma": _GEMMA,
    "orion": _ORION,
    "openchat": _OPENCHAT,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _by_role({"system": _C, "user": "'### Instruction:\\n' + " + _C + " + '\\n'",
                          "assistant": "'### Response:\\n' + " + _C + " + '\\n<|EOT|>\\n'"}, "### Response:\\n"),
    "deepseek2": _by_role({"system": _C + " + '\\n\\n'", "user": "'User: ' + " + _C + " + '\\n\\n'",
                           "assistant": "'Assistant: ' + " + _C + " + '<｜end▁of▁sentence｜>'"}, "Assistant:"),
    "deepseek3": _by_role({"system": _C + " + '\\n\\n'", "user": "'<｜User｜>' + " + _C,
                           "assistant": "'<｜Assistant｜>' + " + _C + " + '<｜end▁of▁sentence｜>'"}, "<｜Assistant｜>"),
    "command-r": _by_role({
        "system": "'<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + " + _CT + " + '<|END_OF_TURN_TOKEN|>'",
        "user": "'<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + " + _CT + " + '<|END_OF_TURN_TOKEN|>'",
        "assistant": "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + " + _CT + " + '<|END_OF_TURN_TOKEN|>'"},
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _each("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + " + _CT
                    + " + '<|eot_id|>' -}}", "<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
    "llama4": _each("{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' + " + _CT
                    + " + '<|eot|>' -}}", "<|header_start|>assistant<|header_end|>\\n\\n"),
    "chatglm3": "[gMASK]sop" + _each("{{- '<|' + message['role'] + '|>\\n ' + " + _C + " -}}", "<|assistant|>"),
    "chatglm4": "[gMASK]<sop>" + _each("{{- '<|' + message['role'] + '|>\\n' + " + _C + " -}}", "<|assistant|>\\n"),
    "glmedge": _each("{{- '<|' + message['role'] + '|>\\n' + " + _C + " -}}", "<|assistant|>"),
    "minicpm": _MINICPM,
    "exaone3": _exaone(tool=False),
    "exaone4": _exaone(tool=True),
    "rwkv-world": _RWKV,
    "granite": _each("{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' -}}"
                     "{%- if message['role'] == 'assistant_tool_call' -%}{{- '<|tool_call|>' -}}{%- endif -%}"
                     "{{- " + _C + " + '<|end_of_text|>\\n' -}}", "<|start_of_role|>assistant<|end_of_role|>\\n"),
    "gigachat": _GIGACHAT,
    "megrez": _each("{{- '<|role_start|>' + message['role'] + '<|role_end|>' + " + _C + " + '<|turn_end|>' -}}",
                    "<|role_start|>assistant<|role_end|>"),
    "yandex": _YANDEX,
    "bailing": _BAILING,
    "smolvlm": _SMOLVLM,
    # llama.cpp's "gpt-oss" (LLM_CHAT_TEMPLATE_OPENAI_MOE): harmony messages without channels
    "gpt-oss": _each("{{- '<|start|>' + message['role'] + '<|message|>' + " + _C + " + "
                     "('<|return|>' if message['role'] == 'assistant' else '<|end|>') -}}", "<|start|>assistant"),
}


def builtin_names() -> list[str]:
    """The built-in template names kvserve has, sorted."""
    return sorted(BUILTIN_TEMPLATES)


class ChatTemplateChoiceError(ValueError):
    """A ``--chat-template`` value that is no file, no built-in name and no Jinja text."""


def resolve_chat_template(value: str) -> tuple[str, str]:
    """What a ``--chat-template`` value means, as ``(kind, Jinja source)``.

    In this order: an existing file's path (vLLM: kind ``"file"``, its text), one of
    llama-server's built-in names (kind ``"builtin"``), inline Jinja text (contains ``{{`` or
    ``{%``: kind ``"inline"``, the text itself).

    Raises:
        ChatTemplateChoiceError: none of these; the message lists the built-in names.
        OSError: the file exists but cannot be read (or is not UTF-8: UnicodeDecodeError).
    """
    if os.path.isfile(os.path.expanduser(value)):
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            return "file", f.read()
    if value in BUILTIN_TEMPLATES:
        return "builtin", BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return "inline", value
    raise ChatTemplateChoiceError(
        f"--chat-template {value!r} is not a file, a built-in template name or Jinja text (Jinja contains "
        f"'{{{{' or '{{%'); built-in names: {', '.join(builtin_names())}")


# -- vLLM's --chat-template-content-format ------------------------------------------------------

def _as_parts(messages: list[dict]) -> list[dict]:
    """Each string content as OpenAI's list of parts (``[{"type": "text", "text": ...}]``)."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def with_content_format(template_cls: type, content_format: str) -> type:
    """The template class that renders message content as ``--chat-template-content-format``
    says (vLLM): ``openai`` gives the template each content as a list of text parts;
    ``string`` gives strings (text parts joined with newlines); ``auto`` inspects the template
    as vLLM does (:attr:`~kvserve.chat.template.ChatTemplate.content_format`: parts as sent for a
    template that loops over content, else strings).

    Args:
        template_cls: :class:`~kvserve.chat.template.ChatTemplate` or a subclass.
        content_format: ``auto`` | ``string`` | ``openai``.
    """
    if content_format == "auto":
        return template_cls
    if content_format == "string":
        class StringContent(template_cls):  # type: ignore[misc, valid-type]
            """``template_cls`` given string content whatever the template reads."""

            content_format = "string"

        return StringContent

    class OpenAIContent(template_cls):  # type: ignore[misc, valid-type]
        """``template_cls`` rendering message content as OpenAI parts."""

        content_format = "openai"  # an array content reaches it as the parts sent

        def render(self, messages, /, add_generation_prompt=True, tools=None, **kwargs):
            return super().render(_as_parts(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                  **kwargs)

    from kvserve.chat.go_chat_template import SystemChatTemplate

    if issubclass(template_cls, SystemChatTemplate):  # the SYSTEM layer's message gets parts too
        class SystemOpenAIContent(template_cls):  # type: ignore[misc, valid-type]
            """``template_cls`` (a default system message) rendering content as OpenAI parts."""

            content_format = "openai"

            def render(self, messages, /, add_generation_prompt=True, tools=None, **kwargs):
                from kvserve.chat.go_chat_template import with_default_system
                from kvserve.chat.template import ChatTemplate

                return ChatTemplate.render(self, _as_parts(with_default_system(messages, self.system)),
                                           add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

        return SystemOpenAIContent
    return OpenAIContent
