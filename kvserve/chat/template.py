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

Rendering is bounded (kvserve's own limits; transformers and vLLM have none): at most
:data:`MAX_RENDER_STEPS` loop iterations plus sandboxed calls/lookups, :data:`MAX_RENDER_SECONDS`
of wall time, no string/list/integer built over :data:`MAX_RENDER_CHARS` (``*``, ``**``, ``+``,
``%``, ``~``, ``center``/``indent``/``join``/``replace``/``format`` and the widening ``str``
methods are checked before they run) and no output over it; recursion past the stack and
MemoryError end in a :class:`TemplateError` too (a 400). The capability probes run under a small
budget and stop after the first probe that goes over it.
"""

from __future__ import annotations

import contextvars
import json
import operator
import re
import time
from datetime import datetime
from typing import Any, Iterable, Iterator

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


# ---------------------------------------------------------------------------------------------
# Rendering budget: a template is code from the model (or a request); one render may not loop,
# build text or recurse without bound (kvserve's own limits; transformers and vLLM have none).
# ---------------------------------------------------------------------------------------------

#: Loop iterations (all ``{% for %}`` loops together) plus sandboxed calls/attribute lookups one
#: render may make; a nested ``range(100000)`` pair (10^10) stops here.
MAX_RENDER_STEPS = 10_000_000
#: Characters one string (or items one list) built by the template may have, and the most the
#: rendered prompt may be (16 Mi).
MAX_RENDER_CHARS = 16 * 2**20
#: Wall-clock seconds one render may take.
MAX_RENDER_SECONDS = 10.0
#: The capability probes (:attr:`ChatTemplate.caps`) run under this smaller budget.
_PROBE_STEPS, _PROBE_SECONDS = 200_000, 1.0


class _BudgetExceeded(Exception):
    """Internal: a render went over its :class:`_Budget`."""


class _Budget:
    """Steps and a deadline for one render (:data:`MAX_RENDER_STEPS`, :data:`MAX_RENDER_SECONDS`)."""

    __slots__ = ("left", "deadline", "_n")

    def __init__(self, steps: int, seconds: float) -> None:
        self.left = steps
        self.deadline = time.monotonic() + seconds
        self._n = 0

    def tick(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _BudgetExceeded("it took too many steps (loop iterations, calls)")
        self._n += 1
        if self._n >= 4096:
            self._n = 0
            if time.monotonic() > self.deadline:
                raise _BudgetExceeded("it took too long")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("kvserve_template_budget", default=None)
#: the (steps, seconds) limits :meth:`ChatTemplate.render` applies: the capability probes lower them
_LIMITS: contextvars.ContextVar[tuple[int, float] | None] = contextvars.ContextVar(
    "kvserve_template_limits", default=None)


def _tick() -> None:
    b = _BUDGET.get()
    if b is not None:
        b.tick()


def _check_size(n: int) -> None:
    if n > MAX_RENDER_CHARS:
        raise _BudgetExceeded(f"it built a value of {n} characters or items (the limit is {MAX_RENDER_CHARS})")


def _sized(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _check_int_bits(bits: float) -> None:
    if bits > MAX_RENDER_CHARS:
        raise _BudgetExceeded(f"it built an integer of about {int(bits)} bits (the limit is {MAX_RENDER_CHARS})")


_WIDTH = re.compile(r"\d{7,}")  # a format width / precision of a million or more


def _check_format(spec: Any) -> None:
    if isinstance(spec, str) and (_WIDTH.search(spec) or "*" in spec and "%" in spec):
        raise _BudgetExceeded("its format string asks for a width of a million characters or more")


class _BudgetExtension(Extension):
    """Wraps every ``{% for %}`` iterable and every ``~`` concatenation of a compiled template in
    budget-counting calls (:class:`_BoundedEnvironment` rewrites the tree before compiling)."""

    def iterate(self, iterable: Iterable) -> Iterator:
        b = _BUDGET.get()
        for x in iterable:
            if b is not None:
                b.tick()
            yield x

    def concat(self, items: list) -> str:
        parts = [str(x) for x in items]
        _check_size(sum(map(len, parts)))
        return "".join(parts)


_STR_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every render under a :class:`_Budget`: loops and calls count steps,
    ``*``/``**``/``+``/``%`` and ``~`` refuse results over :data:`MAX_RENDER_CHARS`, as do the
    text-widening string methods and filters."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _tick()
        if op == "*":
            if isinstance(left, int) and not isinstance(left, bool) and _sized(right):
                _check_size(left * _sized(right))
            elif isinstance(right, int) and not isinstance(right, bool) and _sized(left):
                _check_size(right * _sized(left))
            elif isinstance(left, int) and isinstance(right, int):
                _check_int_bits(left.bit_length() + right.bit_length())
        elif op == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                _check_int_bits(right * abs(left).bit_length())
        elif op == "+":
            if _sized(left) and _sized(right):
                _check_size(len(left) + len(right))
        elif op == "%" and isinstance(left, str):
            _check_format(left)
        return self.binop_table[op](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805, B902
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _STR_WIDTH_METHODS and args and isinstance(args[0], int):
                _check_size(args[0])
            elif name in ("format", "format_map"):
                _check_format(owner)
            elif name == "join" and args:
                items = list(args[0])
                _check_size(sum(len(x) for x in items if isinstance(x, str)) + len(owner) * len(items))
                args = (items,) + args[1:]
            elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
                _check_size(len(owner) + (owner.count(args[0]) if isinstance(args[0], str) else 0) * len(args[1]))
            elif name == "expandtabs":
                _check_size(len(owner) * (args[0] if args and isinstance(args[0], int) else 8))
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def _generate(self, source: nodes.Template, name: Any, filename: Any, defer_init: bool = False) -> str:
        ext = _BudgetExtension.identifier
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.ExtensionAttribute(ext, "iterate"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        for cat in list(source.find_all(nodes.Concat)):
            cat.nodes = [nodes.Call(nodes.ExtensionAttribute(ext, "concat"), [nodes.List(cat.nodes)], [], None, None,
                                    lineno=cat.lineno)]
        return super()._generate(source, name, filename, defer_init)


def _bounded_filter(name: str, check: Any) -> Any:
    """Jinja's filter ``name`` with a size pre-check; ``pass_context`` also keeps Jinja from
    running it at compile time on constant arguments (constant folding)."""
    inner = jinja2.filters.FILTERS[name]

    @jinja2.pass_context
    def f(_ctx: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        check(value, *args, **kwargs)
        if getattr(inner, "jinja_pass_arg", None) is jinja2.utils._PassArg.eval_context:
            return inner(_ctx.eval_ctx, value, *args, **kwargs)
        if getattr(inner, "jinja_pass_arg", None) is jinja2.utils._PassArg.environment:
            return inner(_ctx.environment, value, *args, **kwargs)
        return inner(value, *args, **kwargs)

    return f


def _width_check(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> None:
    n = kwargs.get("width", width)
    if isinstance(n, int):
        lines = str(value).count("\n") + 1 if not isinstance(value, jinja2.Undefined) else 1
        _check_size(n * lines)


def _join_check(value: Any, d: Any = "", *args: Any, **kwargs: Any) -> None:
    if isinstance(value, (list, tuple, str, range, dict)):
        d = kwargs.get("d", d)
        _check_size(len(value) * (len(d) if isinstance(d, str) else 1)
                    + sum(len(x) for x in value if isinstance(x, str)))


def _replace_check(value: Any, old: Any = "", new: Any = "", *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        _check_size(len(value) + (value.count(old) if old else len(value) + 1) * len(new))


def _format_check(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_format(value)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag, _BudgetExtension]
    )
    for name, check in (("center", _width_check), ("indent", _width_check), ("join", _join_check),
                        ("replace", _replace_check), ("format", _format_check)):
        env.filters[name] = _bounded_filter(name, check)
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
        except (RecursionError, MemoryError) as e:  # nesting past the parser's / compiler's stack
            raise TemplateError(f"chat template error: the template is nested too deeply ({type(e).__name__})") from None
        self._caps: dict[str, bool] | None = None
        self._content_format: str | None = None
        self._probe_over = False

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
        limits = _LIMITS.get() or (MAX_RENDER_STEPS, MAX_RENDER_SECONDS)
        return self._render(limits, messages, add_generation_prompt, tools, documents, kwargs)

    def _render(self, limits: tuple[int, float], messages: list[dict], add_generation_prompt: bool,
                tools: list | None, documents: list | None, kwargs: dict) -> str:
        clash = RESERVED_VARIABLES.intersection(kwargs)
        if clash:
            raise TemplateError(f"chat template variable '{min(clash)}' is reserved: it is set by the request")
        ctx: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        ctx.update(kwargs)
        ctx["messages"] = template_messages(messages)
        ctx["tools"] = tools
        ctx["documents"] = documents
        ctx["add_generation_prompt"] = add_generation_prompt
        token = _BUDGET.set(_Budget(*limits))
        try:
            out: list[str] = []
            size = 0
            for chunk in self._tmpl.generate(**ctx):
                size += len(chunk)
                _check_size(size)
                out.append(chunk)
            return "".join(out)
        except _BudgetExceeded as e:
            raise TemplateError(f"chat template error: the template went over kvserve's rendering limits: {e}") from None
        except RecursionError:
            raise TemplateError("chat template error: recursion too deep (a macro or recursive loop that calls "
                                "itself without end, or data nested too deeply)") from None
        except MemoryError:
            raise TemplateError("chat template error: out of memory while rendering") from None
        except OverflowError as e:  # range() over the sandbox's MAX_RANGE, huge float results
            raise TemplateError(f"chat template error: OverflowError: {e}") from None
        except _TemplateRaised as e:
            raise TemplateError(f"chat template error: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        finally:
            _BUDGET.reset(token)

    @property
    def content_format(self) -> str:
        """How message content reaches the template: ``openai`` (a list of ``{"type": "text",
        "text"}`` parts) when the template loops over content, else ``string`` (text parts
        joined with newlines) - vLLM's ``auto`` (:func:`detect_content_format`). Computed once."""
        if self._content_format is None:
            self._content_format = detect_content_format(_ENV.parse(self.source))
        return self._content_format

    def _try(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str:
        if getattr(self, "_probe_over", False):
            return ""
        token = _LIMITS.set((_PROBE_STEPS, _PROBE_SECONDS))
        try:  # through render(): subclasses (SYSTEM layer, Go templates) probe what they render
            return self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except TemplateError as e:
            # a template that goes over the (small) probe budget once is not probed again
            self._probe_over = "rendering limits" in str(e)
            return ""
        finally:
            _LIMITS.reset(token)

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
        self._probe_over = False
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
