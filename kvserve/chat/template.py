"""Chat templates: render HF/GGUF Jinja chat templates into a prompt string.

Rendering follows HF ``transformers`` (``PreTrainedTokenizerBase.apply_chat_template`` and
``transformers.utils.chat_template_utils.render_jinja_template``, version 5): a
``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``; not ``do``, which
transformers does not enable either), a ``tojson`` filter that does not escape HTML or
non-ASCII (``ensure_ascii=False``, ``indent``/``separators``/``sort_keys`` supported), the
globals ``raise_exception``, ``strftime_now`` (local time, as transformers), a ``namespace``
that refuses underscore-prefixed attribute names and a ``dict`` callable, and the variables
``messages``, ``tools`` (the JSON schemas as given), ``documents``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` plus any extra keyword arguments (OpenAI-compatible
``chat_template_kwargs``, e.g. ``enable_thinking``). ``{% generation %}`` blocks (HF
assistant masks) render their body.

Messages are prepared as transformers prepares them: keys whose value is null are dropped
(a request's ``content: null`` never gets here: ``kvserve.chat.prompt.render_chat`` makes it
``""`` first, as vLLM does), and a
message's reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is passed as
both ``reasoning_content`` and ``thinking``. :attr:`ChatTemplate.content_format` tells whether
the template loops over message content (then it is given OpenAI's list of text parts as sent,
else strings: vLLM's ``--chat-template-content-format auto``). Tests:
tests/unit/test_template_parity.py renders templates with kvserve and with transformers and
asserts equal text.

Capability detection (:attr:`ChatTemplate.caps`) renders small probe conversations and looks
for needles in the output, like llama.cpp's minja ``chat_template`` caps detection.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.utils
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "RESERVED_VARIABLES", "ChatTemplate", "TemplateError", "detect_content_format",
           "template_messages"]

#: Variables the renderer sets itself (``messages``, ``tools``, ``add_generation_prompt``) or
#: takes as its own argument (``continue_final_message``, see ``kvserve.chat.prompt.render_chat``):
#: ``chat_template_kwargs`` may not carry them (a 400 names the key; ``--chat-template-kwargs``
#: with one is refused at start-up). ``bos_token``/``eos_token`` may be overridden, and
#: ``documents`` may come from ``chat_template_kwargs`` (as vLLM merges them).
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})

#: Fallback used when a model has no chat template (ChatML, as llama.cpp's default
#: ``chatml`` template and Ollama's generic template). String content only.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TemplateError(ValueError):
    """A chat template failed to compile or render (syntax error, ``raise_exception``,
    undefined operation, sandbox violation). HTTP 400 / 500 depending on the face."""


class _TemplateRaised(Exception):
    """Internal: raised by the template's ``raise_exception(msg)``."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF-compatible: no HTML escaping, non-ASCII kept as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # transformers: the local time, formatted by the template's own format string
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """The template's ``dict``: builds plain dicts (``dict(a=1)``, ``dict.fromkeys(keys)``)
    without exposing the ``dict`` type itself (transformers' ``TemplateDict``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute.")


class _TemplateNamespace(jinja2.utils.Namespace):
    """The template's ``namespace(...)``: Jinja's, refusing names that start with ``_``
    (``{% set ns._x = 1 %}`` or ``namespace(_x=1)``), as transformers' ``TemplateNamespace``."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick (namespace(self=...))
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


#: Names a message's reasoning may come under, in the order transformers looks for them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template (``apply_chat_template``): members
    whose value is None are dropped, and the first non-null of ``reasoning_content``,
    ``thinking``, ``reasoning`` is also set as ``thinking`` (unless present) and as
    ``reasoning_content``. Returns new dicts; non-dict entries are passed through."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF assistant-mask marker): renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_env()

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "some_tool",
        "description": "Some tool.",
        "parameters": {
            "type": "object",
            "properties": {"arg": {"type": "string", "description": "Some argument."}},
            "required": ["arg"],
        },
    },
}


def _probe_call(name: str, args: Any, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` (or its ``[key]`` / ``.key`` member when ``key``),
    through filters, tests and slices (``messages[1:]``, ``message['content'] | list``)."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.name in names
    if isinstance(node, nodes.Getitem):
        return (isinstance(node.node, nodes.Name) and node.node.name in names
                and isinstance(node.arg, nodes.Const) and node.arg.value == key)
    if isinstance(node, nodes.Getattr):
        return isinstance(node.node, nodes.Name) and node.node.name in names and node.attr == key
    return False


def detect_content_format(ast: nodes.Template) -> str:
    """``openai`` when the template loops over a message's content (``{% for part in
    message['content'] %}``, so it takes OpenAI's list of parts), else ``string``: vLLM's
    ``--chat-template-content-format auto`` rule. Messages are ``messages``, any variable set
    from it (``{% set loop_messages = messages[1:] %}``), and the loop variables over those."""
    lists = {"messages"}
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads(assign.node, lists):
            lists.add(assign.target.name)
    items = {loop.target.name for loop in ast.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)}
    if any(_reads(loop.iter, items, "content") for loop in ast.find_all(nodes.For)):
        return "openai"
    return "string"


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja template text (GGUF ``tokenizer.chat_template`` or HF
            ``tokenizer_config.json`` ``chat_template``).
        bos_token / eos_token: texts exposed to the template as ``bos_token``/``eos_token``.

    Raises:
        TemplateError: the template does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._tmpl = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        self._caps: dict[str, bool] | None = None
        self._content_format: str | None = None

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True,
               tools: list | None = None, documents: list | None = None, **kwargs: Any) -> str:
        """Render ``messages`` (OpenAI-style dicts: role, content, tool_calls, ...) to a prompt.

        Args:
            messages: conversation; prepared as transformers does (:func:`template_messages`:
                null members dropped, reasoning aliased), otherwise unchanged.
            add_generation_prompt: append the assistant turn header.
            tools: OpenAI tool definitions (list of JSON-schema dicts, passed as given) or None
                (template sees ``none``).
            documents: RAG documents (list of dicts, e.g. ``title``/``text``) or None, as
                transformers' ``documents`` argument (Command-R, Granite templates read it).
            **kwargs: extra template variables (``chat_template_kwargs``); they may override
                ``bos_token``/``eos_token``, never the names in ``RESERVED_VARIABLES``.

        Returns:
            The prompt text (str), BOS text included only if the template writes it.

        Raises:
            TemplateError: ``raise_exception`` was called, or Jinja failed (undefined
                operation, type error, sandbox violation), or ``kwargs`` holds a reserved name.
        """
        clash = RESERVED_VARIABLES.intersection(kwargs)
        if clash:
            raise TemplateError(f"chat template variable '{min(clash)}' is reserved: it is set by the request")
        ctx: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        ctx.update(kwargs)
        ctx["messages"] = template_messages(messages)
        ctx["tools"] = tools
        ctx["documents"] = documents
        ctx["add_generation_prompt"] = add_generation_prompt
        try:
            return self._tmpl.render(**ctx)
        except _TemplateRaised as e:
            raise TemplateError(f"chat template error: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e

    @property
    def content_format(self) -> str:
        """How message content reaches the template: ``openai`` (a list of ``{"type": "text",
        "text"}`` parts) when the template loops over content, else ``string`` (text parts
        joined with newlines) - vLLM's ``auto`` (:func:`detect_content_format`). Computed once."""
        if self._content_format is None:
            self._content_format = detect_content_format(_ENV.parse(self.source))
        return self._content_format

    def _try(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str:
        try:
            return self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except TemplateError:
            return ""

    @property
    def caps(self) -> dict[str, bool]:
        """What the template supports, detected by rendering probes (llama.cpp minja style).

        Keys: ``supports_tools`` (a tool definition appears in the prompt),
        ``supports_tool_calls`` (an assistant ``tool_calls`` entry appears),
        ``supports_parallel_tool_calls`` (two calls in one message both appear),
        ``supports_tool_responses`` (a ``tool`` role message appears),
        ``supports_system_role`` (a system message's content appears),
        ``requires_object_arguments`` (tool call arguments render only as objects, not
        JSON strings). Computed once, then cached.
        """
        if self._caps is not None:
            return self._caps
        user = {"role": "user", "content": "Hey"}
        sys_needle = "<System Needle>"
        out_sys = self._try([{"role": "system", "content": sys_needle}, user])
        supports_system_role = sys_needle in out_sys

        out_tools = self._try([user], tools=[_PROBE_TOOL], add_generation_prompt=True)
        supports_tools = "some_tool" in out_tools

        args_obj = {"code": "print('Hello, World!')"}
        args_str = json.dumps(args_obj)

        def call_msgs(calls: list[dict]) -> list[dict]:
            return [user, {"role": "assistant", "content": "", "tool_calls": calls}]

        def call_msgs_none(calls: list[dict]) -> list[dict]:
            return [user, {"role": "assistant", "content": None, "tool_calls": calls}]

        def renders_call(calls: list[dict], needles: list[str]) -> bool:
            for msgs in (call_msgs(calls), call_msgs_none(calls)):
                out = self._try(msgs)
                if out and all(n in out for n in needles):
                    return True
            return False

        obj_ok = renders_call([_probe_call("ipython", args_obj, "call_1___")], ["ipython", "Hello, World!"])
        str_ok = renders_call([_probe_call("ipython", args_str, "call_1___")], ["ipython", "Hello, World!"])
        supports_tool_calls = obj_ok or str_ok
        requires_object_arguments = obj_ok and not str_ok
        args = args_obj if requires_object_arguments else args_str
        supports_parallel = supports_tool_calls and renders_call(
            [_probe_call("test_tool1", args, "call_1___"), _probe_call("test_tool2", args, "call_2___")],
            ["test_tool1", "test_tool2"],
        )
        tool_resp = "Some response!"
        out_resp = self._try(
            call_msgs([_probe_call("ipython", args, "call_1___")])
            + [{"role": "tool", "name": "ipython", "tool_call_id": "call_1___", "content": tool_resp}]
        )
        self._caps = {
            "supports_tools": supports_tools,
            "supports_tool_calls": supports_tool_calls,
            "supports_parallel_tool_calls": supports_parallel,
            "supports_tool_responses": tool_resp in out_resp,
            "supports_system_role": supports_system_role,
            "requires_object_arguments": requires_object_arguments,
        }
        return self._caps

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
