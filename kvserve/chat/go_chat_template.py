"""A store model's TEMPLATE and SYSTEM layers behind :class:`~kvserve.chat.template.ChatTemplate`'s
interface, so that every face renders its chats as Ollama would.

What :func:`kvserve.chat.prompt.render_chat` and the tool-call/reasoning features read from a
runner's template: ``source`` (the text: tool-call parsers and capabilities are detected from
it), ``caps`` (probe renders, llama.cpp minja style: inherited, they call :meth:`render`),
``bos_token``/``eos_token`` and ``render(messages, add_generation_prompt=, tools=, **kwargs)``.
Two subclasses give them:

- :class:`GoChatTemplate`: an Ollama TEMPLATE layer (Go ``text/template``), rendered by
  :class:`kvserve.chat.go_template.OllamaTemplate` with Ollama's values: ``.System``,
  ``.Messages`` (``.Role .Content .Thinking .ToolCalls .ToolName``), ``.Tools``, ``.Think``,
  ``.ThinkLevel``, ``.IsThinkSet``; older templates (``.Prompt``/``.Response``) run once per
  turn. OpenAI-style messages are taken as they come from ``normalize_messages``: content
  strings (null: empty), ``tool_calls`` with object arguments, ``reasoning_content``,
  ``tool_call_id`` (the tool's name is looked up from the call it answers); ``developer``
  messages count as ``system``. The template variables map onto Ollama's ``think``:
  ``reasoning_effort`` (``high``/``medium``/``low``/``max``) else ``enable_thinking`` (a bool);
  when neither is given and the template writes thinking blocks (``<think>`` and ``</think>``
  in its text) think is on, as Ollama turns it on for a thinking model by default. Other
  variables (``bos_token``...) are ignored: a Go template has no use for them.
- :class:`SystemChatTemplate`: a Jinja template (the GGUF's or the flags') with the model's
  SYSTEM layer as the default system message.

Both put the SYSTEM layer first when the conversation does not start with a system message
(Ollama's ChatHandler rule): in every face that renders through the runner's template
(/v1/chat/completions, /api/chat, /api/generate, /apply-template, /v1/messages...). Ollama's
own OpenAI endpoints are a translation onto /api/chat, so they apply it too; the /api face
also adds the model's MESSAGE layer, which the other faces do not.

What a Go template cannot do: leave out the generation prompt. ``add_generation_prompt=False``
renders the conversation as Ollama would for it (a template that names ``.Messages`` opens
the assistant's turn after a final user message); continuing a final assistant message works
(``render_chat`` cuts the render after its content, as Ollama's templates leave the last
assistant turn open).
"""

from __future__ import annotations

import logging
from typing import Any

from kvserve.chat.template import RESERVED_VARIABLES, ChatTemplate, TemplateError
from kvserve.errors import InvalidInputError

__all__ = ["GoChatTemplate", "SystemChatTemplate", "store_layers", "with_default_system"]

log = logging.getLogger("kvserve.server")

_THINK_LEVELS = ("high", "medium", "low", "max")


def with_default_system(messages: list[dict], system: str) -> list[dict]:
    """``messages`` with ``{"role": "system", "content": system}`` first unless they already
    start with a system message (or ``system`` is empty, or there are no messages)."""
    if not system or not messages or messages[0].get("role") in ("system", "developer"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _think(template_text: str, kwargs: dict) -> bool | str | None:
    effort = kwargs.get("reasoning_effort")
    if isinstance(effort, str) and effort in _THINK_LEVELS:
        return effort
    enable = kwargs.get("enable_thinking")
    if isinstance(enable, bool):
        return enable
    if "<think>" in template_text and "</think>" in template_text:
        return True
    return None


def _ollama_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if msg.get("content") is None:
            msg["content"] = ""
        out.append(msg)
    return out


class GoChatTemplate(ChatTemplate):
    """An Ollama TEMPLATE layer used as a runner's chat template (see the module docstring).

    Args:
        text: the Go template text.
        bos_token / eos_token: the tokenizer's texts (kept for ``/props``; the template does not
            see them).
        system: the model's SYSTEM layer ("" for none): the default system message.

    Raises:
        TemplateError: the text does not parse or uses what kvserve's Go renderer refuses.
    """

    def __init__(self, text: str, bos_token: str = "", eos_token: str = "", system: str = ""):
        from kvserve.chat.go_template import GoTemplateError, OllamaTemplate

        self.source = text
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.system = system
        self._caps = None
        try:
            self.go = OllamaTemplate(text)
        except GoTemplateError as e:
            raise TemplateError(f"template error: {e}") from None

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True,
               tools: list | None = None, **kwargs: Any) -> str:
        """The prompt Ollama renders for ``messages`` and ``tools`` (see the module docstring).

        Raises:
            TemplateError: a reserved variable in ``kwargs``, the template failed on these
                values, or a message cannot be given to it.
        """
        from kvserve.chat.go_template import GoTemplateError

        clash = RESERVED_VARIABLES.intersection(kwargs)
        if clash:
            raise TemplateError(f"chat template variable '{min(clash)}' is reserved: it is set by the request")
        msgs = _ollama_messages(with_default_system(messages, self.system))
        try:
            return self.go.render(msgs, tools=tools, think=_think(self.source, kwargs))
        except GoTemplateError as e:
            raise TemplateError(f"chat template error: {e}") from None
        except InvalidInputError as e:
            raise TemplateError(e.message) from None

    def __repr__(self) -> str:
        return f"GoChatTemplate({len(self.source)} chars)"


class SystemChatTemplate(ChatTemplate):
    """A Jinja chat template with the model's SYSTEM layer as the default system message.

    Args:
        source, bos_token, eos_token: as for :class:`ChatTemplate`.
        system: the SYSTEM layer's text.

    Raises:
        TemplateError: the template does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", system: str = ""):
        super().__init__(source, bos_token, eos_token)
        self.system = system

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True,
               tools: list | None = None, **kwargs: Any) -> str:
        """:meth:`ChatTemplate.render` of the messages with the SYSTEM layer first (module docstring)."""
        return super().render(with_default_system(messages, self.system), add_generation_prompt=add_generation_prompt,
                              tools=tools, **kwargs)


def store_layers(models_dir: str | None, name: str, model_path: str) -> tuple[str | None, str]:
    """``(TEMPLATE text or None, SYSTEM text)`` of the store model ``name`` whose weights are
    ``model_path``; ``(None, "")`` when ``name`` is not a store model (a path, an alias), its
    weights are another file, or its layers cannot be read (logged). An empty TEMPLATE counts
    as none."""
    from kvserve.store import open_store

    try:
        store = open_store(models_dir)
        stored = store.get(name)
    except (ValueError, OSError):  # not an Ollama name (InvalidModelNameError), unreadable store
        return None, ""
    if stored is None or (model_path and stored.model_path is not None
                          and str(stored.model_path) != str(model_path)):
        return None, ""
    try:
        template = store.layer_text(stored.manifest, "template")
        system = store.layer_text(stored.manifest, "system") or ""
    except (OSError, ValueError) as e:
        log.warning("model '%s': cannot read its TEMPLATE/SYSTEM layers: %s", name, e)
        return None, ""
    return (template or None), system
