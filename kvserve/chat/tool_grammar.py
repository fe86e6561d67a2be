"""Grammars that force a tool call, for ``tool_choice: "required"`` or a named function.

:func:`tool_call_grammar` returns xgrammar EBNF text (compile it with
``xgrammar.GrammarCompiler.compile_grammar``) that accepts one call, or with ``parallel``
one or more, in the chosen parser's format, and nothing else: the grammar starts the call
at the first token, because a model that is not trained for tools (or a random one) never
writes the marker by itself (llama-server's required-tool grammar allows free text before the
marker; seed 000 Example 13 needs a prefill to get around that). vLLM forces required and
named calls with structured outputs the same way (seed 002 Example 10).

Formats (``name`` is one of the tools, ``ARGS`` that tool's ``parameters`` schema; a tool
without parameters takes exactly ``{}``):

* ``hermes``: ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, parallel
  calls separated by ``"\\n"``.
* ``llama3_json``: ``{"name": "NAME", "parameters": ARGS}``, separated by ``"; "``.
* ``mistral``: ``[TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]``.
* ``granite``: ``[{"name": "NAME", "arguments": ARGS}, ...]``; ``phi4_mini_json`` the same after
  ``functools``; ``longcat``: ``hermes``'s under ``<longcat_tool_call>``; ``granite4`` as ``hermes``,
  ``mimo`` as ``qwen3_coder``.
* ``llama4_json`` and ``llama4_pythonic``: as ``llama3_json`` and ``pythonic``.

* ``qwen3_coder``/``qwen3_xml``, ``seed_oss``, ``glm45``/``glm47``, ``minimax_m2``: the call's
  opening (``<tool_call>\\n<function=NAME>\\n``, ``<tool_call>NAME\\n``,
  ``<minimax:tool_call>\\n<invoke name="NAME">\\n``...), then the parameters as xgrammar's
  ``qwen_xml`` / ``glm_xml`` / ``minimax_xml`` JSON-schema styles write them (string values as
  text, others as JSON), then the closing; parallel calls separated by ``"\\n"``.

The other parsers (``kimi_k2``, ``deepseek_v3``/``v31``, ``openai``) have no
grammar: ``tool_choice`` ``required`` or a named function answers 400 with them.
* ``pythonic``: ``[NAME(key=value, ...), ...]`` with Python literals (``True``/``None``), one
  keyword per schema property in schema order (optional ones may be left out).

JSON arguments use xgrammar's JSON-schema conversion in strict mode (no extra properties)
with the separators ``", "`` and ``": "`` and no other whitespace, so a weak model cannot
wander off into whitespace. Every call starts with :func:`tool_call_prefix`, so a prefill such
as ``"<tool_call>\\n"`` fed to the matcher with ``accept_string`` keeps the grammar valid.

Needs ``xgrammar`` (imported when a grammar is built).
"""

from __future__ import annotations

import json
import keyword
from typing import Any

__all__ = ["TOOL_GRAMMAR_FORMATS", "tool_call_grammar", "tool_call_prefix", "tool_functions"]

#: parser name -> (text before the first call, call header before the name, key of the
#: arguments, text after the arguments, separator between parallel calls, text after the last call)
_JSON_FORMATS: dict[str, tuple[str, str, str, str, str, str]] = {
    "hermes": ("", '<tool_call>\n{"name": ', "arguments", "}\n</tool_call>", "\n", ""),
    "llama3_json": ("", '{"name": ', "parameters", "}", "; ", ""),
    "mistral": ("[TOOL_CALLS][", '{"name": ', "arguments", "}", ", ", "]"),
    "granite": ("[", '{"name": ', "arguments", "}", ", ", "]"),
    "phi4_mini_json": ("functools[", '{"name": ', "arguments", "}", ", ", "]"),
    "longcat": ("", '<longcat_tool_call>\n{"name": ', "arguments", "}\n</longcat_tool_call>", "\n", ""),
}

#: parsers whose calls are another parser's format (vLLM registers the same class)
_SAME_FORMAT = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder",
                "glm47": "glm45", "granite4": "hermes", "mimo": "qwen3_coder"}

#: XML formats: parser name -> (xgrammar JSONSchemaFormat style, text before the parameters
#: ({name} is the function), text after them, separator between parallel calls)
_XML_FORMATS: dict[str, tuple[str, str, str, str]] = {
    "qwen3_coder": ("qwen_xml", "<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>", "\n"),
    "seed_oss": ("qwen_xml", "<seed:tool_call>\n<function={name}>\n", "\n</function>\n</seed:tool_call>", "\n"),
    "glm45": ("glm_xml", "<tool_call>{name}\n", "\n</tool_call>", "\n"),
    "minimax_m2": ("minimax_xml", '<minimax:tool_call>\n<invoke name="{name}">\n', "\n</invoke>\n</minimax:tool_call>",
                   "\n"),
}

#: Parser names :func:`tool_call_grammar` supports.
TOOL_GRAMMAR_FORMATS = (*_JSON_FORMATS, "pythonic", *_SAME_FORMAT, *_XML_FORMATS)


def tool_call_prefix(parser_name: str) -> str:
    """Text every forced call starts with (a safe assistant prefill), e.g. ``"<tool_call>\\n"``."""
    parser_name = _SAME_FORMAT.get(parser_name, parser_name)
    if parser_name == "pythonic":
        return "["
    if parser_name in _XML_FORMATS:
        return _XML_FORMATS[parser_name][1].split("{name}", 1)[0]
    if parser_name not in _JSON_FORMATS:
        raise ValueError(_unknown(parser_name))
    before, head, *_ = _JSON_FORMATS[parser_name]
    return before + head.split("{", 1)[0] if not head.startswith("{") else before + "{"


def tool_functions(tools: list[dict]) -> list[tuple[str, dict | None]]:
    """(name, parameters schema or None) of each tool, OpenAI ``{"type": "function",
    "function": {...}}`` or flat ``{"name", "parameters"}`` form; ValueError on a bad entry."""
    out = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("each tool needs a function name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        out.append((name, params))
    return out


def tool_call_grammar(parser_name: str, tools: list[dict], *, required_name: str | None = None,
                      parallel: bool = False) -> str:
    """EBNF text forcing at least one valid call (exactly one unless ``parallel``).

    Args:
        parser_name: a name from :data:`TOOL_GRAMMAR_FORMATS`.
        tools: the request's ``tools``.
        required_name: only this function may be called (named ``tool_choice``).
        parallel: allow more calls after the first (``parallel_tool_calls``).

    Raises:
        ValueError: unknown parser, no tools, ``required_name`` not among them, a schema
            xgrammar cannot convert, or (pythonic) a name/property that is not an identifier.
    """
    from kvserve.structured.xgr import xgrammar_module

    xgr = xgrammar_module()
    from xgrammar import structural_tag as st

    if parser_name not in TOOL_GRAMMAR_FORMATS:
        raise ValueError(_unknown(parser_name))
    parser_name = _SAME_FORMAT.get(parser_name, parser_name)
    funcs = tool_functions(tools)
    if required_name is not None:
        funcs = [f for f in funcs if f[0] == required_name][:1]
        if not funcs:
            raise ValueError(f"tool_choice names function {required_name!r}, which is not in tools")
    if not funcs:
        raise ValueError("a forced tool call needs at least one tool")

    if parser_name == "pythonic":
        calls = [st.SequenceFormat(elements=[
            st.ConstStringFormat(value=f"{_py_name(name)}("),
            st.GrammarFormat(grammar=_PyKwargs(params).ebnf()),
            st.ConstStringFormat(value=")")]) for name, params in funcs]
        before, sep, after = "[", ", ", "]"
    elif parser_name in _XML_FORMATS:
        style, head, tail, sep = _XML_FORMATS[parser_name]
        calls = [st.SequenceFormat(elements=[
            st.ConstStringFormat(value=head.format(name=_xml_name(name))),
            *([] if _no_params(params) else [_xml_params(st, name, params, style)]),
            st.ConstStringFormat(value=tail)]) for name, params in funcs]
        before = after = ""
    else:
        before, head, key, tail, sep, after = _JSON_FORMATS[parser_name]
        calls = [st.SequenceFormat(elements=[
            st.ConstStringFormat(value=f'{head}{json.dumps(name, ensure_ascii=False)}, "{key}": '),
            _args_format(xgr, st, name, params),
            st.ConstStringFormat(value=tail)]) for name, params in funcs]
    one = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
    body: Any = one
    if parallel:
        body = st.SequenceFormat(elements=[one, st.StarFormat(content=st.SequenceFormat(
            elements=[st.ConstStringFormat(value=sep), one]))])
    parts = [p for p in (st.ConstStringFormat(value=before) if before else None, body,
                         st.ConstStringFormat(value=after) if after else None) if p is not None]
    fmt = parts[0] if len(parts) == 1 else st.SequenceFormat(elements=parts)
    try:
        return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt)))
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
        raise ValueError(f"cannot build the tool call grammar: {e}") from e


def _xml_name(name: str) -> str:
    if not name or any(c in name for c in "{}<>\"' \t\n\r"):
        raise ValueError(f"tool name {name!r} cannot be written in an XML tool call")
    return name


def _xml_params(st: Any, name: str, params: dict, style: str) -> Any:
    try:
        # at most one whitespace character around values and between parameters: a weak model
        # cannot wander off, and the parsers' one-newline strip gives back the exact value
        return st.JSONSchemaFormat(json_schema=params, style=style, max_whitespace_cnt=1)
    except Exception as e:  # pydantic validation: an xgrammar without this style
        raise ValueError(f"tool {name!r}: parameters cannot be forced in the {style} format: {e}") from e


def _unknown(parser_name: str) -> str:
    return f"no tool call grammar for parser {parser_name!r}; valid: {', '.join(TOOL_GRAMMAR_FORMATS)}"


def _no_params(params: dict | None) -> bool:
    if not params:
        return True
    return (params.get("type", "object") == "object" and not params.get("properties")
            and not params.get("additionalProperties") and not params.get("patternProperties"))


def _args_format(xgr: Any, st: Any, name: str, params: dict | None) -> Any:
    if _no_params(params):
        return st.ConstStringFormat(value="{}")
    try:
        g = xgr.Grammar.from_json_schema(json.dumps(params), any_whitespace=False, separators=(", ", ": "),
                                         strict_mode=True)
    except Exception as e:
        raise ValueError(f"tool {name!r}: parameters schema not supported: {e}") from e
    return st.GrammarFormat(grammar=str(g))


# ---------------------------------------------------------------------------------------------
# pythonic: JSON schema -> EBNF of Python keyword arguments with literal values
# ---------------------------------------------------------------------------------------------

_PY_BASE = r'''
py_char ::= [^"\\\0-\x1f] | "\\" ["\\/bfnrt] | "\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
py_string ::= "\"" py_char* "\""
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_num ::= py_int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
py_bool ::= "True" | "False"
py_none ::= "None"
py_any ::= py_string | py_num | py_bool | py_none | py_list_any | py_dict_any
py_list_any ::= "[" "]" | "[" py_any (", " py_any)* "]"
py_dict_any ::= "{" "}" | "{" py_string ": " py_any (", " py_string ": " py_any)* "}"
'''


def _lit(s: str) -> str:
    """An EBNF string literal for s."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _py_literal(v: Any) -> str:
    """Python source of a JSON value (strings double-quoted with JSON escapes)."""
    if v is None:
        return "None"
    if v is True:
        return "True"
    if v is False:
        return "False"
    if isinstance(v, (int, float, str)):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_py_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(json.dumps(str(k), ensure_ascii=False) + ": " + _py_literal(x)
                               for k, x in v.items()) + "}"
    raise ValueError(f"unsupported literal {v!r}")


def _py_name(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"tool name {name!r} is not a Python identifier (pythonic format)")
    return name


class _PyKwargs:
    """Builds the EBNF for ``key=value, ...`` of one tool (schema subset: type, enum, const,
    anyOf/oneOf, properties/required, items; string/number limits are not enforced)."""

    def __init__(self, params: dict | None) -> None:
        self.rules: list[str] = []
        self.n = 0
        self.params = params or {}

    def ebnf(self) -> str:
        props = self.params.get("properties") or {}
        required = set(self.params.get("required") or ())
        items = []
        for key, sub in props.items():
            if not key.isidentifier() or keyword.iskeyword(key):
                raise ValueError(f"parameter {key!r} is not a Python identifier (pythonic format)")
            items.append((_lit(f"{key}="), self.value(sub), key in required))
        root = self.chain(items)
        return f"root ::= {root}\n" + _PY_BASE + "\n".join(self.rules) + "\n"

    def rule(self, body: str) -> str:
        self.n += 1
        name = f"py_r{self.n}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def chain(self, items: list[tuple[str, str, bool]]) -> str:
        """Rule for the items in order, each optional one may be left out, ", " between."""
        rest = self.rule('""')  # R_n: nothing more
        first = rest  # S_n
        for key, val, req in reversed(items):
            item = f"{key} {val}"
            new_rest = self.rule(f'", " {item} {rest}' if req else f'(", " {item})? {rest}')
            first = self.rule(f"{item} {rest}" if req else f"{item} {rest} | {first}")
            rest = new_rest
        return first

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict) or not schema:
            return "py_any"
        if "const" in schema:
            return self.rule(_lit(_py_literal(schema["const"])))
        if "enum" in schema:
            return self.rule(" | ".join(_lit(_py_literal(v)) for v in schema["enum"]) or '""')
        for k in ("anyOf", "oneOf"):
            if isinstance(schema.get(k), list) and schema[k]:
                return self.rule(" | ".join(self.value(s) for s in schema[k]))
        t = schema.get("type")
        if isinstance(t, list):
            return self.rule(" | ".join(self.value({**schema, "type": x}) for x in t) or "py_any")
        if t is None and "properties" in schema:
            t = "object"
        if t == "string":
            return "py_string"
        if t == "integer":
            return "py_int"
        if t == "number":
            return "py_num"
        if t == "boolean":
            return "py_bool"
        if t == "null":
            return "py_none"
        if t == "array":
            item = self.value(schema.get("items", {}))
            body = f'"[" {item} (", " {item})* "]"'
            return self.rule(body if (schema.get("minItems") or 0) > 0 else f'"[" "]" | {body}')
        if t == "object":
            props = schema.get("properties")
            if not props:
                return "py_dict_any" if schema.get("additionalProperties", True) is not False else self.rule('"{" "}"')
            required = set(schema.get("required") or ())
            items = [(_lit(json.dumps(k, ensure_ascii=False) + ": "), self.value(s), k in required)
                     for k, s in props.items()]
            return self.rule(f'"{{" {self.chain(items)} "}}"')
        return "py_any"
