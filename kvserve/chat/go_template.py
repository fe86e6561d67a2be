"""Go ``text/template`` for Ollama's TEMPLATE layers, and the data Ollama renders them with.

Ollama stores a model's prompt format as a Go template (``application/vnd.ollama.image.template``)
and renders it with Go's ``text/template`` (option ``missingkey=zero``) and four functions of
its own (``template/template.go``). This module is a renderer for that language, written from
Go's documentation and semantics, plus Ollama's execution rules:

- :class:`GoTemplate` parses and executes Go template text: text and actions, ``{{-``/``-}}``
  trimming, ``{{/* comments */}}``, pipelines with ``|``, parenthesised pipelines, fields
  (``.A.B``), ``$`` and variables (``$x := ...``, ``$x = ...``, ``$i, $m := ...`` in range),
  ``if``/``else if``/``else``/``end``, ``range`` (slices, maps in sorted key order, integers)
  with ``else``, ``break`` and ``continue``, ``with``/``else with``, ``define``/``template``/
  ``block``, and the functions ``and or not len index slice eq ne lt le gt ge print printf
  println html js urlquery`` plus Ollama's ``json currentDate yesterdayDate toTypeScriptType``.
- :class:`OllamaTemplate` is Ollama's ``template.Parse``/``Execute``: ``{{ .Response }}`` is
  appended to a template that names neither ``Messages`` nor ``Response``; a template that names
  ``Messages`` gets the whole conversation once; an older one (``.System``/``.Prompt``/
  ``.Response`` only) is executed once per turn, the last turn cut after ``.Response``.
- :func:`template_messages`, :func:`template_tools` and :func:`chat_values` build the values
  Ollama passes (``System``, ``Messages``, ``Tools``, ``Response``, ``Think``, ``ThinkLevel``,
  ``IsThinkSet``) from OpenAI-style or Ollama-style chat messages and tools.

Go's semantics are the specification: truthiness (empty strings, slices and maps, zero numbers,
nil are false; structs are true), ``eq`` with several arguments (true if the first equals any),
comparisons only between values of one basic kind (``incompatible types for comparison``
otherwise), ``and``/``or`` returning the deciding argument and stopping there, a missing map key
giving nil (printed ``<no value>``), a missing struct field being an error, ``len``/``slice``/
``index`` on strings counting bytes, numbers printed as Go's ``%v`` prints them, and ``json`` and
the JSON that Ollama's types print being Go's ``encoding/json`` (map keys sorted, ``<``, ``>``
and ``&`` escaped as ``\\u003c``...).

Values: templates see plain data only: ``str``, ``bool``, ``int`` (Go int), ``float`` (Go
float64), ``None`` (nil), ``list`` (a slice), ``dict`` with string keys (a map) and
:class:`GoStruct` (a struct, with Go field names). :class:`GoList` and :class:`GoMap` add what
Go's named types carry: a nil slice/map, or a ``String()`` method that prints JSON (Ollama's
``.Tools`` and ``.Function.Arguments``). No attribute of any Python object is ever read.

What it refuses (a :class:`GoTemplateSyntaxError` at parse time, naming the construct and its
line and column): method calls and ``call`` (the data has no methods or functions), complex
numbers, unknown functions, and everything Go's parser refuses. At execution
(:class:`GoTemplateExecError`): what Go refuses at execution, printing a struct that has no
``String()`` method (Go would print its memory layout), and ``printf`` verbs or argument
mismatches that Go would print as ``%!v(...)`` noise. Execution is bounded: output size,
nested template calls and evaluation steps (:class:`RenderLimits`).
"""

from __future__ import annotations

import math
import re
import unicodedata
import urllib.parse
from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import Decimal
from typing import Any, Callable, Iterable

from kvserve.errors import InvalidInputError

__all__ = [
    "GoList", "GoMap", "GoStruct", "GoTemplate", "GoTemplateError", "GoTemplateExecError",
    "GoTemplateLimitError", "GoTemplateSyntaxError", "JsonObject", "OllamaTemplate",
    "PropertyType", "RenderLimits", "chat_values", "collate", "go_json", "go_sprint",
    "merge_model_messages", "template_messages", "template_tools",
]


# --------------------------------------------------------------------------------------------
# Errors


class GoTemplateError(InvalidInputError):
    """A Go template could not be parsed or executed.

    Attributes:
        line, col: 1-based position in the template text of the construct at fault (0 if none).
        construct: the template text of that construct (``{{else}}``, ``.Foo``, ``printf``...).
    """

    def __init__(self, message: str, *, line: int = 0, col: int = 0, construct: str = ""):
        super().__init__(message)
        self.line, self.col, self.construct = line, col, construct


class GoTemplateSyntaxError(GoTemplateError):
    """The template text is not a template this renderer can run (Go's parse errors, plus the
    constructs it refuses). Message: ``template: :LINE:COL: ...``."""


class GoTemplateExecError(GoTemplateError):
    """Executing the template failed on this data (Go's execution errors). Message:
    ``template: :LINE:COL: executing "" at <CONSTRUCT>: ...``."""


class GoTemplateLimitError(GoTemplateExecError):
    """Execution went past a :class:`RenderLimits` bound (output size, template-call depth,
    evaluation steps)."""


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """Bounds on one execution.

    Attributes:
        max_output_chars: characters of output (a prompt longer than this is refused).
        max_call_depth: nested ``{{ template }}`` calls (Go: 100000; recursion is how a Go
            template loops forever).
        max_steps: evaluated nodes and range iterations (``range`` over a huge integer).
    """

    max_output_chars: int = 32 << 20
    max_call_depth: int = 100
    max_steps: int = 10_000_000


#: Most nested control structures and parentheses the parser takes (Python's stack is finite).
MAX_NESTING = 100


# --------------------------------------------------------------------------------------------
# Values with Go types


class GoStruct:
    """A Go struct value (or pointer to one) as a template sees it.

    Args:
        type_name: the Go type name used in messages (``*template.templateMessage``).
        fields: Go field name -> value, in declaration order.
        json: what ``encoding/json`` writes for it: a JSON-able tree in which
            :class:`JsonObject` keeps field order (default: the fields under their Go names,
            as for a struct without JSON tags).
        stringer: the type has a ``String()`` method returning its JSON (printing it prints that).
        ts_type: for Ollama's ``api.ToolProperty``: what ``toTypeScriptType`` answers.
    """

    __slots__ = ("type_name", "fields", "json", "stringer", "ts_type")

    def __init__(self, type_name: str, fields: dict[str, Any], json: Any = None,
                 stringer: bool = False, ts_type: str | None = None):
        self.type_name, self.fields, self.stringer, self.ts_type = type_name, fields, stringer, ts_type
        self.json = JsonObject(fields.items()) if json is None else json

    def __repr__(self) -> str:
        return f"GoStruct({self.type_name!r}, {self.fields!r})"


class JsonObject(tuple):
    """A JSON object whose members keep this order (a Go struct, or Ollama's ordered maps):
    a tuple of ``(key, value)`` pairs. A plain ``dict`` encodes with sorted keys, as Go maps do."""

    __slots__ = ()


class GoList(list):
    """A slice of a named Go type: ``nil`` (a nil slice: empty, JSON ``null``) and ``stringer``
    (its ``String()`` prints its JSON, as Ollama's ``templateTools``)."""

    __slots__ = ("nil", "stringer")

    def __init__(self, items: Iterable[Any] = (), *, nil: bool = False, stringer: bool = False):
        super().__init__(items)
        self.nil, self.stringer = nil, stringer


class GoMap(dict):
    """A map of a named Go type: ``nil`` (a nil map: empty, JSON ``null``), ``stringer`` (its
    ``String()`` prints its JSON, ``{}`` when nil, as Ollama's ``templateArgs``)."""

    __slots__ = ("nil", "stringer")

    def __init__(self, items: Any = (), *, nil: bool = False, stringer: bool = False):
        super().__init__(items)
        self.nil, self.stringer = nil, stringer


class PropertyType(list):
    """Ollama's ``api.PropertyType``: a JSON schema ``type`` (one name or several). Prints as the
    name (``[a b]`` for several); JSON is the name, or an array for several."""

    __slots__ = ()


_KIND_NAMES = {bool: "bool", int: "int", float: "float64", str: "string"}


def _type_name(v: Any) -> str:
    """The Go type name of a value, for messages."""
    if v is None:
        return "<nil>"
    if isinstance(v, GoStruct):
        return v.type_name
    if isinstance(v, PropertyType):
        return "api.PropertyType"
    if isinstance(v, (list, tuple)):
        return "[]interface {}"
    if isinstance(v, dict):
        return "map[string]interface {}"
    return _KIND_NAMES.get(type(v), type(v).__name__)


def _basic_kind(v: Any) -> str | None:
    """Go's basicKind: bool, int, float, string; None for anything else."""
    t = type(v)
    if t is bool:
        return "bool"
    if t is int:
        return "int"
    if t is float:
        return "float"
    if t is str:
        return "string"
    return None


def _check_value(v: Any) -> Any:
    """Refuse a Python object that is not template data (templates read no attributes)."""
    if v is None or type(v) in (bool, int, float, str) or isinstance(v, (list, dict, GoStruct)):
        return v
    raise TypeError(f"unsupported template value of type {type(v).__name__}")


def go_truth(v: Any) -> bool:
    """Go's ``isTrue``: nil, false, 0, empty strings, slices and maps are false; structs true."""
    if v is None:
        return False
    if isinstance(v, GoStruct):
        return True
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    if isinstance(v, (bool, int, float)):
        return v != 0
    return True


# --------------------------------------------------------------------------------------------
# Go's number and string formatting


def _float_digits(f: float) -> tuple[str, int]:
    """Shortest decimal digits of ``abs(f)`` (as Go's strconv finds them) and the decimal point
    position: ``abs(f) == 0.DIGITS * 10**dp``. ``f`` is finite and not zero."""
    sign, digits, exp = Decimal(repr(abs(f))).as_tuple()
    ds = "".join(map(str, digits)).lstrip("0")
    stripped = ds.rstrip("0")
    exp += len(ds) - len(stripped)
    return stripped, len(stripped) + exp


def _fmt_e(ds: str, dp: int, upper: bool = False) -> str:
    exp = dp - 1
    mant = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
    return f"{mant}{'E' if upper else 'e'}{'-' if exp < 0 else '+'}{abs(exp):02d}"


def _fmt_f(ds: str, dp: int) -> str:
    if dp <= 0:
        return "0." + "0" * -dp + ds
    if dp >= len(ds):
        return ds + "0" * (dp - len(ds))
    return ds[:dp] + "." + ds[dp:]


def _special_float(f: float) -> str | None:
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "-0" if math.copysign(1, f) < 0 else "0"
    return None


def go_format_float(f: float) -> str:
    """Go's ``%v`` of a float64 (``strconv.FormatFloat(f, 'g', -1, 64)``): shortest digits,
    exponent form below 1e-4 and from 1e6 (``1e+06``, ``1.048576e+06``, ``1e-05``)."""
    special = _special_float(f)
    if special is not None:
        return special
    ds, dp = _float_digits(f)
    exp = dp - 1
    body = _fmt_e(ds, dp) if exp < -4 or exp >= 6 else _fmt_f(ds, dp)
    return ("-" if f < 0 else "") + body


def go_json_float(f: float) -> str:
    """A float64 as Go's ``encoding/json`` writes it: positional unless below 1e-6 or from 1e21,
    exponent without a leading zero (``1e-7``). NaN and infinities raise ValueError."""
    if math.isnan(f) or math.isinf(f):
        raise ValueError(f"json: unsupported value: {go_format_float(f)}")
    if f == 0:
        return "-0" if math.copysign(1, f) < 0 else "0"
    ds, dp = _float_digits(f)
    if abs(f) < 1e-6 or abs(f) >= 1e21:
        body = _fmt_e(ds, dp)
        body = re.sub(r"e-0(\d)$", r"e-\1", body)
    else:
        body = _fmt_f(ds, dp)
    return ("-" if f < 0 else "") + body


def _go_isprint(ch: str) -> bool:
    """Go's unicode.IsPrint: letters, marks, numbers, punctuation, symbols and ASCII space."""
    return ch == " " or unicodedata.category(ch)[0] in "LMNPS"


_QUOTE_ESCAPES = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t",
                  "\v": r"\v", "\\": r"\\", '"': r"\""}


def go_quote(s: str) -> str:
    """Go's ``strconv.Quote`` (``%q``): a double-quoted Go string literal."""
    out = ['"']
    for ch in s:
        if ch in _QUOTE_ESCAPES:
            out.append(_QUOTE_ESCAPES[ch])
        elif _go_isprint(ch):
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            out.append("\\ufffd")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
                 "\f": "\\f"}


def _json_string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in _JSON_ESCAPES:
            out.append(_JSON_ESCAPES[ch])
        elif ch < " " or ch in "<>&\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        elif "\ud800" <= ch <= "\udfff":
            out.append("\\ufffd")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def go_json(v: Any) -> str:
    """``v`` as Go's ``json.Marshal`` writes it: compact, map keys sorted, HTML characters
    escaped (``\\u003c``), floats in Go's form, ``\\b``/``\\f`` short escapes (Go 1.22+).

    Accepts template values (:class:`GoStruct` encodes its ``json`` tree, nil
    :class:`GoList`/:class:`GoMap` as ``null``) and plain JSON data. Raises ValueError for NaN
    or infinities (Go's ``unsupported value``) and TypeError for other Python objects.
    """
    parts: list[str] = []
    _json_into(v, parts, 0)
    return "".join(parts)


def _json_into(v: Any, out: list[str], depth: int) -> None:
    if depth > 200:
        raise ValueError("json: value nested too deeply")
    if v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif type(v) is int:
        out.append(str(v))
    elif type(v) is float:
        out.append(go_json_float(v))
    elif isinstance(v, str):
        out.append(_json_string(v))
    elif isinstance(v, GoStruct):
        _json_into(v.json, out, depth + 1)
    elif isinstance(v, PropertyType):
        _json_into(v[0] if len(v) == 1 else list(v), out, depth + 1)
    elif isinstance(v, JsonObject):
        _json_members(list(v), out, depth)
    elif isinstance(v, (GoList, GoMap)) and v.nil:
        out.append("null")
    elif isinstance(v, dict):
        _json_members(sorted(v.items()), out, depth)
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, item in enumerate(v):
            if i:
                out.append(",")
            _json_into(item, out, depth + 1)
        out.append("]")
    else:
        raise TypeError(f"json: unsupported type: {type(v).__name__}")


def _json_members(pairs: list[tuple[str, Any]], out: list[str], depth: int) -> None:
    out.append("{")
    for i, (k, item) in enumerate(pairs):
        if i:
            out.append(",")
        out.append(_json_string(str(k)))
        out.append(":")
        _json_into(item, out, depth + 1)
    out.append("}")


def _stringer_text(v: Any) -> str | None:
    """What a value's ``String()`` method returns, for the Ollama types that have one."""
    if isinstance(v, PropertyType):
        return "" if not v else v[0] if len(v) == 1 else "[" + " ".join(v) + "]"
    if isinstance(v, GoMap) and v.stringer:
        return "{}" if v.nil else _json_or_empty(v)
    if (isinstance(v, GoList) and v.stringer) or (isinstance(v, GoStruct) and v.stringer):
        return _json_or_empty(v)
    return None


def _json_or_empty(v: Any) -> str:
    """Ollama's ``json`` function and ``String()`` methods ignore Marshal's error: ``""``."""
    try:
        return go_json(v)
    except (ValueError, TypeError):
        return ""


def go_sprint_value(v: Any, depth: int = 0) -> str:
    """Go's ``%v`` of one value (``fmt.Sprint(v)``). Raises TypeError for a struct without a
    ``String()`` method: Go prints its fields or, inside a slice, its address."""
    text = _stringer_text(v)
    if text is not None:
        return text
    if v is None:
        return "<nil>"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if type(v) is int:
        return str(v)
    if type(v) is float:
        return go_format_float(v)
    if isinstance(v, str):
        return v
    if isinstance(v, GoStruct):
        raise TypeError(f"can't print a value of type {v.type_name}: Go prints its memory layout")
    if depth > 100:
        raise TypeError("value nested too deeply to print")
    if isinstance(v, dict):
        return "map[" + " ".join(f"{go_sprint_value(k, depth + 1)}:{go_sprint_value(x, depth + 1)}"
                                 for k, x in sorted(v.items())) + "]"
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(go_sprint_value(x, depth + 1) for x in v) + "]"
    raise TypeError(f"unsupported template value of type {type(v).__name__}")


class OutputTooLongError(ValueError):
    """A formatting function's result would pass its ``max_chars`` bound (raised before the
    whole result is built, so a small format cannot allocate a huge string)."""


def _check_size(size: int, max_chars: int | None) -> None:
    if max_chars is not None and size > max_chars:
        raise OutputTooLongError(f"result longer than {max_chars} characters")


def go_sprint(*args: Any, max_chars: int | None = None) -> str:
    """Go's ``fmt.Sprint``: operands' ``%v`` with a space between two that are not strings.
    Raises OutputTooLongError as soon as the result passes ``max_chars`` (None: no bound)."""
    out: list[str] = []
    size = 0
    prev_string = False
    for i, a in enumerate(args):
        is_string = isinstance(a, str)
        if i > 0 and not is_string and not prev_string:
            out.append(" ")
            size += 1
        text = go_sprint_value(a)
        size += len(text)
        _check_size(size, max_chars)
        out.append(text)
        prev_string = is_string
    return "".join(out)


def go_sprintln(*args: Any, max_chars: int | None = None) -> str:
    """Go's ``fmt.Sprintln``: operands' ``%v`` separated by spaces, then a newline. Raises
    OutputTooLongError as soon as the result passes ``max_chars`` (None: no bound)."""
    out: list[str] = []
    size = 1
    for a in args:
        text = go_sprint_value(a)
        size += len(text) + (1 if out else 0)
        _check_size(size, max_chars)
        out.append(text)
    return " ".join(out) + "\n"


#: Largest width or precision ``printf`` takes: Go's fmt prints ``%!(BADWIDTH)`` /
#: ``%!(BADPREC)`` above 1e6 (its ``tooLarge``); here it is an error, checked before formatting.
MAX_PRINTF_WIDTH = 1_000_000

_VERB = re.compile(r"%([-+# 0]*)(\*|\d+)?(?:\.(\*|\d*))?([a-zA-Z%])")


def go_sprintf(fmt: str, *args: Any, max_chars: int | None = None) -> str:
    """Go's ``fmt.Sprintf`` for the verbs templates use: ``%v %s %q %d %t %f %F %e %E %g %G
    %x %X %c %%`` with flags ``-+# 0``, width and precision. Raises TypeError where Go would
    print ``%!verb(...)`` (a verb that does not fit its argument, a missing or extra argument,
    a width or precision above :data:`MAX_PRINTF_WIDTH`, a ``*`` width or precision), and
    OutputTooLongError as soon as the result passes ``max_chars`` (None: no bound)."""
    out: list[str] = []
    size = 0
    argi = 0
    pos = 0
    while True:
        i = fmt.find("%", pos)
        if i < 0:
            out.append(fmt[pos:])
            _check_size(size + len(out[-1]), max_chars)
            break
        out.append(fmt[pos:i])
        size += i - pos
        m = _VERB.match(fmt, i)
        if not m:
            raise TypeError(f"printf: bad verb in format {fmt[i:i + 10]!r}")
        flags, width, prec, verb = m.group(1), m.group(2), m.group(3), m.group(4)
        pos = m.end()
        if verb == "%":
            out.append("%")
            size += 1
            continue
        if width == "*" or prec == "*":
            raise TypeError("printf: '*' width or precision is not supported")
        for what, num in (("width", width), ("precision", prec)):
            if num and int(num) > MAX_PRINTF_WIDTH:
                raise TypeError(f"printf: {what} {int(num)} is larger than {MAX_PRINTF_WIDTH}")
        if argi >= len(args):
            raise TypeError(f"printf: missing argument for %{verb}")
        arg = args[argi]
        argi += 1
        text = _format_verb(verb, flags, None if prec is None else int(prec or 0), arg)
        _check_size(size + max(len(text), int(width) if width else 0), max_chars)
        text = _pad(text, flags, int(width) if width else 0, verb, arg)
        size += len(text)
        out.append(text)
    if argi < len(args):
        raise TypeError(f"printf: {len(args) - argi} extra argument(s) for format {fmt!r}")
    return "".join(out)


def _pad(text: str, flags: str, width: int, verb: str, arg: Any) -> str:
    if len(text) >= width:
        return text
    if "-" in flags:
        return text + " " * (width - len(text))
    if "0" in flags and verb in "dfFeEgGxX" and type(arg) in (int, float):
        sign = text[0] if text[:1] in "+- " else ""
        return sign + "0" * (width - len(text)) + text[len(sign):]
    return " " * (width - len(text)) + text


def _sign(text: str, flags: str, negative: bool) -> str:
    if negative:
        return text
    if "+" in flags:
        return "+" + text
    if " " in flags:
        return " " + text
    return text


def _format_verb(verb: str, flags: str, prec: int | None, arg: Any) -> str:
    t = type(arg)
    if verb == "v":
        if "#" in flags and isinstance(arg, str):
            return go_quote(arg)
        return go_sprint_value(arg)
    if verb == "s" and t is not bool and t is not int and t is not float and arg is not None:
        s = _stringer_text(arg)
        s = go_sprint_value(arg) if s is None else s
        return s if prec is None else s[:prec]
    if verb == "q" and isinstance(arg, str):
        return go_quote(arg)
    if verb == "t" and t is bool:
        return "true" if arg else "false"
    if verb in "dxXc" and t is int:
        if verb == "c":  # Go writes U+FFFD for a value that is not a Unicode scalar
            return chr(arg) if 0 <= arg <= 0x10FFFF and not 0xD800 <= arg <= 0xDFFF else "\ufffd"
        body = str(abs(arg)) if verb == "d" else format(abs(arg), verb)
        if verb != "d" and "#" in flags:
            body = "0" + verb + body
        return _sign(("-" if arg < 0 else "") + body, flags, arg < 0)
    if verb in "xX" and isinstance(arg, str):
        return arg.encode().hex() if verb == "x" else arg.encode().hex().upper()
    if verb in "fFeEgG" and t is float:
        return _sign(_format_float_verb(verb, prec, arg), flags, arg < 0 or _special_float(arg) == "-0")
    raise TypeError(f"%{verb} does not fit a value of type {_type_name(arg)}")


def _format_float_verb(verb: str, prec: int | None, f: float) -> str:
    special = _special_float(f)
    if special is not None and special not in ("0", "-0"):
        return special
    if verb in "fF":
        return f"{f:.{6 if prec is None else prec}f}"
    if verb in "eE":
        s = f"{f:.{6 if prec is None else prec}e}"
        return s.upper() if verb == "E" else s
    if prec is None:
        s = go_format_float(f)
        return s.upper() if verb == "G" else s
    s = f"{f:.{max(prec, 1)}g}"
    return s.upper() if verb == "G" else s


# --------------------------------------------------------------------------------------------
# Lexer (Go's text/template/parse/lex.go, item by item)

_SPACE = " \t\r\n"
_KEYWORDS = {"block", "break", "continue", "define", "else", "end", "if", "range", "nil",
             "template", "with"}


@dataclass(slots=True)
class _Item:
    typ: str  # text, comment, left, right, space, ident, field, variable, dot, string, raw,
    #           char, number, bool, nil, pipe, lparen, rparen, assign, declare, punct, keyword, eof
    val: str
    pos: int


def _is_alnum(ch: str) -> bool:
    return ch == "_" or ch.isalpha() or ch.isdigit()


class _Lexer:
    def __init__(self, text: str, template: "GoTemplate"):
        self.text, self.t = text, template
        self.items: list[_Item] = []
        self.pos = 0

    def error(self, msg: str, pos: int | None = None) -> None:
        self.t.syntax_error(msg, self.pos if pos is None else pos)

    def run(self) -> list[_Item]:
        text, n = self.text, len(self.text)
        while self.pos < n:
            start = self.pos
            i = text.find("{{", start)
            if i < 0:
                self.items.append(_Item("text", text[start:], start))
                self.pos = n
                break
            trim = text.startswith("-", i + 2) and i + 3 < n and text[i + 3] in _SPACE
            end = i
            if trim:
                end = len(text[start:i].rstrip(_SPACE)) + start
            if end > start:
                self.items.append(_Item("text", text[start:end], start))
            self.pos = i + 2 + (2 if trim else 0)
            if text.startswith("/*", self.pos):
                self.comment(i)
            else:
                self.items.append(_Item("left", "{{", i))
                self.action()
        self.items.append(_Item("eof", "", n))
        return self.items

    def at_right(self) -> tuple[bool, bool]:
        """(at a right delimiter, with a trim marker)."""
        text, p = self.text, self.pos
        if p + 1 < len(text) and text[p] in _SPACE and text[p + 1] == "-" and text.startswith("}}", p + 2):
            return True, True
        return text.startswith("}}", p), False

    def close_right(self, trim: bool) -> None:
        self.pos += (2 if trim else 0) + 2
        if trim:
            rest = self.text[self.pos:]
            self.pos += len(rest) - len(rest.lstrip(_SPACE))

    def comment(self, start: int) -> None:
        j = self.text.find("*/", self.pos + 2)
        if j < 0:
            self.error("unclosed comment", start)
        self.pos = j + 2
        delim, trim = self.at_right()
        if not delim:
            self.error("comment ends before closing delimiter", start)
        self.items.append(_Item("comment", self.text[start:self.pos], start))
        self.close_right(trim)

    def action(self) -> None:
        text, depth = self.text, 0
        while True:
            delim, trim = self.at_right()
            if delim:
                if depth:
                    self.error("unclosed left paren")
                self.items.append(_Item("right", "}}", self.pos))
                self.close_right(trim)
                return
            if self.pos >= len(text):
                self.error("unclosed action")
            start, ch = self.pos, text[self.pos]
            if ch in _SPACE:
                self.space()
                continue
            self.pos += 1
            if ch == "=":
                self.emit("assign", start)
            elif ch == ":":
                if not text.startswith("=", self.pos):
                    self.error("expected :=")
                self.pos += 1
                self.emit("declare", start)
            elif ch == "|":
                self.emit("pipe", start)
            elif ch == '"':
                self.quote(start)
            elif ch == "`":
                j = text.find("`", self.pos)
                if j < 0:
                    self.error("unterminated raw quoted string", start)
                self.pos = j + 1
                self.emit("raw", start)
            elif ch == "$":
                self.field_or_variable("variable", start)
            elif ch == "'":
                self.char(start)
            elif ch == "." and not (self.pos < len(text) and text[self.pos].isdigit()):
                self.field_or_variable("field", start)
            elif ch in "+-." or ch.isdigit():
                self.pos = start
                self.number()
            elif _is_alnum(ch):
                self.pos = start
                self.identifier()
            elif ch == "(":
                depth += 1
                self.emit("lparen", start)
            elif ch == ")":
                depth -= 1
                if depth < 0:
                    self.error("unexpected right paren U+0029 ')'", start)
                self.emit("rparen", start)
            elif ord(ch) < 0x80 and _go_isprint(ch):
                self.emit("punct", start)
            else:
                self.error(f"unrecognized character in action: U+{ord(ch):04X} {ch!r}", start)

    def emit(self, typ: str, start: int) -> None:
        self.items.append(_Item(typ, self.text[start:self.pos], start))

    def space(self) -> None:
        start, text = self.pos, self.text
        while self.pos < len(text) and text[self.pos] in _SPACE:
            self.pos += 1
        # " -}}": the space before the trim marker belongs to the delimiter.
        if text.startswith("-}}", self.pos) and self.pos - 1 >= start:
            self.pos -= 1
            if self.pos == start:
                return
        self.emit("space", start)

    def at_terminator(self) -> bool:
        text, p = self.text, self.pos
        if p >= len(text):
            return True
        return text[p] in _SPACE or text[p] in ".,|:)(" or text.startswith("}}", p)

    def field_or_variable(self, typ: str, start: int) -> None:
        if self.at_terminator():
            self.emit("variable" if typ == "variable" else "dot", start)
            return
        text = self.text
        while self.pos < len(text) and _is_alnum(text[self.pos]):
            self.pos += 1
        if not self.at_terminator():
            self.error(f"bad character U+{ord(text[self.pos]):04X} {text[self.pos]!r}")
        self.emit(typ, start)

    def identifier(self) -> None:
        start, text = self.pos, self.text
        while self.pos < len(text) and _is_alnum(text[self.pos]):
            self.pos += 1
        if not self.at_terminator():
            self.error(f"bad character U+{ord(text[self.pos]):04X} {text[self.pos]!r}")
        word = text[start:self.pos]
        if word in _KEYWORDS:
            self.emit("nil" if word == "nil" else "keyword", start)
        elif word in ("true", "false"):
            self.emit("bool", start)
        else:
            self.emit("ident", start)

    def quote(self, start: int) -> None:
        text = self.text
        while True:
            if self.pos >= len(text) or text[self.pos] == "\n":
                self.error("unterminated quoted string", start)
            ch = text[self.pos]
            self.pos += 1
            if ch == "\\":
                if self.pos >= len(text) or text[self.pos] == "\n":
                    self.error("unterminated quoted string", start)
                self.pos += 1
            elif ch == '"':
                break
        self.emit("string", start)

    def char(self, start: int) -> None:
        text = self.text
        while True:
            if self.pos >= len(text) or text[self.pos] == "\n":
                self.error("unterminated character constant", start)
            ch = text[self.pos]
            self.pos += 1
            if ch == "\\":
                self.pos += 1
            elif ch == "'":
                break
        self.emit("char", start)

    _NUMBER = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F_]*(?:\.[0-9a-fA-F_]*)?(?:[pP][+-]?[0-9_]+)?"
                         r"|0[oO][0-7_]*|0[bB][01_]*"
                         r"|[0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9_]+)?)i?")

    def number(self) -> None:
        start = self.pos
        m = self._NUMBER.match(self.text, start)
        self.pos = m.end()
        if self.pos < len(self.text) and _is_alnum(self.text[self.pos]):
            self.error(f"bad number syntax: {self.text[start:self.pos + 1]!r}", start)
        if self.text[self.pos - 1:self.pos] == "i" or self.text.startswith(("+", "-"), self.pos):
            self.t.syntax_error("complex numbers are not supported", start)
        self.emit("number", start)


# --------------------------------------------------------------------------------------------
# Parse tree


@dataclass(slots=True)
class _Node:
    pos: int


@dataclass(slots=True)
class _Text(_Node):
    text: str


@dataclass(slots=True)
class _List(_Node):
    nodes: list


@dataclass(slots=True)
class _Field(_Node):
    idents: tuple  # ("A", "B") for .A.B


@dataclass(slots=True)
class _Variable(_Node):
    name: str      # "$", "$x"
    idents: tuple  # fields after it: $x.A.B


@dataclass(slots=True)
class _Chain(_Node):
    node: Any      # (pipeline).A.B
    idents: tuple


@dataclass(slots=True)
class _Identifier(_Node):
    name: str


@dataclass(slots=True)
class _Dot(_Node):
    pass


@dataclass(slots=True)
class _Nil(_Node):
    pass


@dataclass(slots=True)
class _Const(_Node):
    value: Any     # str, bool, int, float
    text: str


@dataclass(slots=True)
class _Command(_Node):
    args: list


@dataclass(slots=True)
class _Pipe(_Node):
    decl: list     # variable names
    is_assign: bool
    cmds: list


@dataclass(slots=True)
class _Action(_Node):
    pipe: _Pipe


@dataclass(slots=True)
class _Branch(_Node):
    kind: str      # if, range, with
    pipe: _Pipe
    body: _List
    else_body: _List | None


@dataclass(slots=True)
class _Break(_Node):
    pass


@dataclass(slots=True)
class _Continue(_Node):
    pass


@dataclass(slots=True)
class _TemplateCall(_Node):
    name: str
    pipe: _Pipe | None


@dataclass(slots=True)
class _End(_Node):
    pass


@dataclass(slots=True)
class _Else(_Node):
    chained: str | None  # "if"/"with" for {{ else if }} / {{ else with }}


#: Functions a template may call (Go's builtins and Ollama's four).
FUNCTIONS = frozenset({"and", "or", "not", "len", "index", "slice", "eq", "ne", "lt", "le", "gt",
                       "ge", "print", "printf", "println", "html", "js", "urlquery", "json",
                       "currentDate", "yesterdayDate", "toTypeScriptType"})

_REFUSED_FUNCTIONS = {"call": "the template data has no functions to call"}

_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\", "'": "'", '"': '"'}


def _go_unquote(tok: str, quote: str) -> str:
    """A Go interpreted string or rune literal's value (``strconv.Unquote``)."""
    body, out, i = tok[1:-1], [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        e = body[i + 1] if i + 1 < len(body) else ""
        if e in _ESCAPES and (e != "'" or quote == "'") and (e != '"' or quote == '"'):
            out.append(_ESCAPES[e])
            i += 2
        elif e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i + 2:i + 2 + n]
            if len(digits) != n or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise ValueError("invalid syntax")
            cp = int(digits, 16)
            if e == "x":
                out.append(bytes([cp]).decode("latin-1") if cp < 0x80 else chr(cp))
            else:
                if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                    raise ValueError("invalid syntax")
                out.append(chr(cp))
            i += 2 + n
        elif e in "01234567":
            digits = body[i + 1:i + 4]
            if len(digits) != 3 or not all(c in "01234567" for c in digits) or int(digits, 8) > 255:
                raise ValueError("invalid syntax")
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            raise ValueError("invalid syntax")
    return "".join(out)


def _parse_number(text: str) -> int | float:
    """A Go template number literal's value: int unless it has a fraction or exponent."""
    t = text.replace("_", "")
    sign = -1 if t.startswith("-") else 1
    t = t.lstrip("+-")
    lower = t.lower()
    if lower.startswith("0x") and "p" in lower:
        return sign * float.fromhex(t)
    if lower.startswith(("0x", "0o", "0b")):
        return sign * int(t, 0)
    if "." in t or "e" in lower:
        return sign * float(t)
    if len(t) > 1 and t.startswith("0"):
        return sign * int(t, 8)  # Go: a leading 0 is octal
    return sign * int(t)


class _Parser:
    """Go's text/template/parse/parse.go, over the lexer's items."""

    def __init__(self, template: "GoTemplate", items: list[_Item]):
        self.t, self.items, self.i = template, items, 0
        self.vars: list[str] = ["$"]
        self.range_depth = 0
        self.depth = 0

    # item stream ---------------------------------------------------------------------------
    def next(self) -> _Item:
        item = self.items[self.i]
        self.i += 1
        return item

    def backup(self, n: int = 1) -> None:
        self.i -= n

    def peek(self) -> _Item:
        return self.items[self.i]

    def next_non_space(self) -> _Item:
        item = self.next()
        while item.typ == "space":
            item = self.next()
        return item

    def peek_non_space(self) -> _Item:
        item = self.next_non_space()
        self.backup()
        return item

    def error(self, msg: str, pos: int) -> None:
        self.t.syntax_error(msg, pos)

    def unexpected(self, item: _Item, context: str) -> None:
        shown = "EOF" if item.typ == "eof" else (f"<{item.val}>" if item.typ == "keyword"
                                                 else go_quote(item.val) if len(item.val) <= 10
                                                 else go_quote(item.val[:10]) + "...")
        self.error(f"unexpected {shown} in {context}", item.pos)

    def expect(self, typ: str, context: str) -> _Item:
        item = self.next_non_space()
        if item.typ != typ:
            self.unexpected(item, context)
        return item

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            self.error(f"nesting deeper than {MAX_NESTING} levels", pos)

    # structure -----------------------------------------------------------------------------
    def parse(self) -> _List:
        root = _List(0, [])
        while self.peek().typ != "eof":
            if self.peek().typ == "left":
                start = self.i
                self.next()
                nxt = self.next_non_space()
                if nxt.typ == "keyword" and nxt.val == "define":
                    self.definition()
                    continue
                self.i = start
            node = self.text_or_action()
            if isinstance(node, (_End, _Else)):
                self.error(f"unexpected {{{{{'end' if isinstance(node, _End) else 'else'}}}}}", node.pos)
            if node is not None:
                root.nodes.append(node)
        return root

    def definition(self) -> None:
        tok = self.next_non_space()
        if tok.typ not in ("string", "raw"):
            self.unexpected(tok, "define clause")
        name = self.string_value(tok)
        self.expect("right", "define clause")
        saved_vars, self.vars = self.vars, ["$"]
        body, end = self.item_list()
        self.vars = saved_vars
        if not isinstance(end, _End):
            self.error("unexpected {{else}} in define clause", end.pos)
        self.t.add_definition(name, body, tok.pos)

    def item_list(self) -> tuple[_List, _Node]:
        lst = _List(self.peek_non_space().pos, [])
        while self.peek_non_space().typ != "eof":
            node = self.text_or_action()
            if isinstance(node, (_End, _Else)):
                return lst, node
            if node is not None:
                lst.nodes.append(node)
        self.error("unexpected EOF", self.peek().pos)
        raise AssertionError

    def text_or_action(self) -> _Node | None:
        tok = self.next_non_space()
        if tok.typ == "text":
            return _Text(tok.pos, tok.val)
        if tok.typ == "left":
            return self.action()
        if tok.typ == "comment":
            return None
        self.unexpected(tok, "input")
        raise AssertionError

    def action(self) -> _Node:
        tok = self.next_non_space()
        if tok.typ == "keyword":
            handler = {"block": self.block, "break": self.loop_control, "continue": self.loop_control,
                       "else": self.else_control, "end": self.end_control, "if": self.control,
                       "range": self.control, "template": self.template_control,
                       "with": self.control}.get(tok.val)
            if handler is not None:
                return handler(tok)
        self.backup()
        pos = self.peek().pos
        return _Action(pos, self.pipeline("command", "right"))

    def loop_control(self, tok: _Item) -> _Node:
        nxt = self.next_non_space()
        if nxt.typ != "right":
            self.unexpected(nxt, f"{{{{{tok.val}}}}}")
        if self.range_depth == 0:
            self.error(f"{{{{{tok.val}}}}} outside {{{{range}}}}", tok.pos)
        return _Break(tok.pos) if tok.val == "break" else _Continue(tok.pos)

    def end_control(self, tok: _Item) -> _Node:
        self.expect("right", "end")
        return _End(tok.pos)

    def else_control(self, tok: _Item) -> _Node:
        peek = self.peek_non_space()
        if peek.typ == "keyword" and peek.val in ("if", "with"):
            return _Else(tok.pos, peek.val)
        self.expect("right", "else")
        return _Else(tok.pos, None)

    def control(self, tok: _Item) -> _Node:
        kind = tok.val
        self.enter(tok.pos)
        n_vars = len(self.vars)
        pipe = self.pipeline(kind, "right")
        if kind == "range":
            self.range_depth += 1
        body, nxt = self.item_list()
        if kind == "range":
            self.range_depth -= 1
        else_body = None
        if isinstance(nxt, _Else):
            if nxt.chained is not None and nxt.chained == kind and kind in ("if", "with"):
                self.next_non_space()  # the "if"/"with" of "else if"/"else with"
                else_body = _List(nxt.pos, [self.control(_Item("keyword", kind, nxt.pos))])
            elif nxt.chained is not None:
                self.error(f"unexpected <{nxt.chained}> in else", nxt.pos)
            else:
                else_body, end = self.item_list()
                if not isinstance(end, _End):
                    self.error("expected end; found {{else}}", end.pos)
        self.vars = self.vars[:n_vars]
        self.depth -= 1
        return _Branch(tok.pos, kind, pipe, body, else_body)

    def block(self, tok: _Item) -> _Node:
        name_tok = self.next_non_space()
        if name_tok.typ not in ("string", "raw"):
            self.unexpected(name_tok, "block clause")
        name = self.string_value(name_tok)
        pipe = self.pipeline("block clause", "right")
        saved_vars, self.vars = self.vars, ["$"]
        body, end = self.item_list()
        self.vars = saved_vars
        if not isinstance(end, _End):
            self.error("unexpected {{else}} in block clause", end.pos)
        self.t.add_definition(name, body, name_tok.pos)
        return _TemplateCall(tok.pos, name, pipe)

    def template_control(self, tok: _Item) -> _Node:
        name_tok = self.next_non_space()
        if name_tok.typ not in ("string", "raw"):
            self.unexpected(name_tok, "template clause")
        name = self.string_value(name_tok)
        pipe = None
        if self.next_non_space().typ != "right":
            self.backup()
            pipe = self.pipeline("template clause", "right")
        return _TemplateCall(tok.pos, name, pipe)

    # pipelines -----------------------------------------------------------------------------
    def pipeline(self, context: str, end: str) -> _Pipe:
        pipe = _Pipe(self.peek_non_space().pos, [], False, [])
        self.declarations(pipe, context)
        while True:
            tok = self.next_non_space()
            if tok.typ == end:
                self.check_pipeline(pipe, context, tok)
                return pipe
            if tok.typ in ("bool", "char", "dot", "field", "ident", "number", "nil", "raw", "string",
                           "variable", "lparen"):
                self.backup()
                pipe.cmds.append(self.command())
            else:
                self.unexpected(tok, context)

    def declarations(self, pipe: _Pipe, context: str) -> None:
        while True:
            v = self.peek_non_space()
            if v.typ != "variable":
                return
            start = self.i
            self.next_non_space()
            nxt = self.peek_non_space()
            if nxt.typ in ("assign", "declare"):
                pipe.is_assign = nxt.typ == "assign"
                self.next_non_space()
                pipe.decl.append(v.val)
                if pipe.is_assign:
                    self.use_var(v)
                else:
                    self.vars.append(v.val)
                return
            if nxt.typ == "punct" and nxt.val == ",":
                self.next_non_space()
                pipe.decl.append(v.val)
                self.vars.append(v.val)
                if context == "range" and len(pipe.decl) < 2:
                    if self.peek_non_space().typ in ("variable", "right", "rparen"):
                        continue
                    self.error("range can only initialize variables", v.pos)
                self.error(f"too many declarations in {context}", v.pos)
            self.i = start  # not a declaration: "$x" is the first operand
            return

    def check_pipeline(self, pipe: _Pipe, context: str, tok: _Item) -> None:
        if not pipe.cmds:
            self.error(f"missing value for {context}", tok.pos)
        for n, cmd in enumerate(pipe.cmds[1:], start=2):
            if isinstance(cmd.args[0], (_Const, _Dot, _Nil)):
                self.error(f"non executable command in pipeline stage {n}", cmd.pos)

    def command(self) -> _Command:
        cmd = _Command(self.peek_non_space().pos, [])
        while True:
            self.peek_non_space()
            operand = self.operand()
            if operand is not None:
                cmd.args.append(operand)
            tok = self.next()
            if tok.typ == "space":
                continue
            if tok.typ in ("right", "rparen"):
                self.backup()
            elif tok.typ != "pipe":
                self.unexpected(tok, "operand")
            break
        if not cmd.args:
            self.error("empty command", cmd.pos)
        return cmd

    def operand(self) -> Any:
        node = self.term()
        if node is None:
            return None
        if self.peek().typ == "field":
            idents = []
            while self.peek().typ == "field":
                idents.append(self.next().val[1:])
            if isinstance(node, _Field):
                return _Field(node.pos, node.idents + tuple(idents))
            if isinstance(node, _Variable):
                return _Variable(node.pos, node.name, node.idents + tuple(idents))
            if isinstance(node, (_Const, _Nil, _Dot)):
                self.error(f"unexpected . after term {self.t.source(node)!r}", node.pos)
            return _Chain(node.pos, node, tuple(idents))
        return node

    def term(self) -> Any:
        tok = self.next_non_space()
        typ = tok.typ
        if typ == "ident":
            if tok.val in _REFUSED_FUNCTIONS:
                self.error(f"function {tok.val!r} is not supported: {_REFUSED_FUNCTIONS[tok.val]}", tok.pos)
            if tok.val not in FUNCTIONS:
                self.error(f'function "{tok.val}" not defined', tok.pos)
            return _Identifier(tok.pos, tok.val)
        if typ == "dot":
            return _Dot(tok.pos)
        if typ == "nil":
            return _Nil(tok.pos)
        if typ == "variable":
            return self.use_var(tok)
        if typ == "field":
            return _Field(tok.pos, (tok.val[1:],))
        if typ == "bool":
            return _Const(tok.pos, tok.val == "true", tok.val)
        if typ == "number":
            try:
                return _Const(tok.pos, _parse_number(tok.val), tok.val)
            except ValueError:
                self.error(f"illegal number syntax: {tok.val!r}", tok.pos)
        if typ == "char":
            try:
                value = _go_unquote(tok.val, "'")
            except ValueError:
                value = ""
            if len(value) != 1:
                self.error(f"malformed character constant: {tok.val}", tok.pos)
            return _Const(tok.pos, ord(value), tok.val)
        if typ == "lparen":
            self.enter(tok.pos)
            pipe = self.pipeline("parenthesized pipeline", "rparen")
            self.depth -= 1
            return pipe
        if typ in ("string", "raw"):
            return _Const(tok.pos, self.string_value(tok), tok.val)
        self.backup()
        return None

    def string_value(self, tok: _Item) -> str:
        if tok.typ == "raw":
            return tok.val[1:-1].replace("\r", "")
        try:
            return _go_unquote(tok.val, '"')
        except ValueError:
            self.error("invalid syntax", tok.pos)
            raise AssertionError

    def use_var(self, tok: _Item) -> _Variable:
        name, *fields = tok.val.split(".")
        if name not in self.vars:
            self.error(f'undefined variable "{name}"', tok.pos)
        return _Variable(tok.pos, name, tuple(fields))


# --------------------------------------------------------------------------------------------
# Execution


class _BreakSignal(Exception):
    pass


class _ContinueSignal(Exception):
    pass


_MISSING = object()  # no final (piped) argument


class _State:
    """One execution: the variable stack, the output and the limits' counters."""

    def __init__(self, template: "GoTemplate", limits: RenderLimits):
        self.t, self.limits = template, limits
        self.vars: list[list] = []  # [name, value] pairs, innermost last
        self.out: list[str] = []
        self.size = 0
        self.steps = 0
        self.call_depth = 0
        self.node: Any = None

    # errors and limits ---------------------------------------------------------------------
    def error(self, msg: str, node: Any = None) -> None:
        node = node if node is not None else self.node
        self.t.exec_error(msg, node)

    def step(self, node: Any) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            self.t.exec_error(f"more than {self.limits.max_steps} evaluation steps", node,
                              cls=GoTemplateLimitError)

    def write(self, s: str, node: Any) -> None:
        self.size += len(s)
        if self.size > self.limits.max_output_chars:
            self.t.exec_error(f"output longer than {self.limits.max_output_chars} characters", node,
                              cls=GoTemplateLimitError)
        self.out.append(s)

    # variables -----------------------------------------------------------------------------
    def var(self, name: str, node: Any) -> Any:
        for pair in reversed(self.vars):
            if pair[0] == name:
                return pair[1]
        self.error(f"undefined variable: {name}", node)

    def set_var(self, name: str, value: Any, node: Any) -> None:
        for pair in reversed(self.vars):
            if pair[0] == name:
                pair[1] = value
                return
        self.error(f"undefined variable: {name}", node)

    # walking -------------------------------------------------------------------------------
    def walk(self, dot: Any, node: Any) -> None:
        self.step(node)
        t = type(node)
        if t is _Text:
            self.write(node.text, node)
        elif t is _List:
            for n in node.nodes:
                self.walk(dot, n)
        elif t is _Action:
            value = self.pipeline(dot, node.pipe)
            if not node.pipe.decl:
                self.print_value(value, node)
        elif t is _Branch:
            if node.kind == "range":
                self.walk_range(dot, node)
            else:
                self.walk_if_with(dot, node)
        elif t is _Break:
            raise _BreakSignal
        elif t is _Continue:
            raise _ContinueSignal
        elif t is _TemplateCall:
            self.walk_template(dot, node)
        else:  # pragma: no cover - the parser makes no other nodes
            self.error(f"unknown node {t.__name__}", node)

    def walk_if_with(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            value = self.pipeline(dot, node.pipe)
            if go_truth(value):
                self.walk(value if node.kind == "with" else dot, node.body)
            elif node.else_body is not None:
                self.walk(dot, node.else_body)
        finally:
            del self.vars[mark:]

    def walk_range(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            value = self.pipeline(dot, node.pipe)
            pairs = self.range_pairs(value, node)
            inner = len(self.vars)
            ran = False
            for index, elem in pairs:
                ran = True
                self.step(node)
                self.bind_range_vars(node.pipe, index, elem)
                try:
                    self.walk(elem, node.body)
                except _ContinueSignal:
                    pass
                except _BreakSignal:
                    break
                finally:
                    del self.vars[inner:]
            if not ran and node.else_body is not None:
                self.walk(dot, node.else_body)
        finally:
            del self.vars[mark:]

    def range_pairs(self, value: Any, node: _Branch) -> Iterable[tuple[Any, Any]]:
        if value is None:
            return ()
        if isinstance(value, dict):
            return sorted(value.items())
        if isinstance(value, (list, tuple)):
            return enumerate(value)
        if type(value) is int:
            if len(node.pipe.decl) > 1:
                self.error("can't use range over integer with two variables", node)
            return ((i, i) for i in range(value))
        self.error(f"range can't iterate over a value of type {_type_name(value)}", node)

    def bind_range_vars(self, pipe: _Pipe, index: Any, elem: Any) -> None:
        decl = pipe.decl
        if not decl:
            return
        if pipe.is_assign:
            if len(decl) > 1:
                self.set_var(decl[0], index, pipe)
                self.set_var(decl[1], elem, pipe)
            else:
                self.set_var(decl[0], elem, pipe)
            return
        # the pipeline pushed the declared variables: the last is the element, the first the index
        self.vars[-1][1] = elem
        if len(decl) > 1:
            self.vars[-2][1] = index

    def walk_template(self, dot: Any, node: _TemplateCall) -> None:
        body = self.t.definitions.get(node.name)
        if body is None:
            self.error(f'no such template "{node.name}"', node)
        new_dot = self.pipeline(dot, node.pipe) if node.pipe is not None else None
        if self.call_depth >= self.limits.max_call_depth:
            self.t.exec_error(f"exceeded maximum template depth ({self.limits.max_call_depth})", node,
                              cls=GoTemplateLimitError)
        saved = self.vars
        self.vars = [["$", new_dot]]
        self.call_depth += 1
        try:
            self.walk(new_dot, body)
        finally:
            self.call_depth -= 1
            self.vars = saved

    # pipelines and commands ----------------------------------------------------------------
    def pipeline(self, dot: Any, pipe: _Pipe) -> Any:
        value = _MISSING
        for cmd in pipe.cmds:
            value = self.command(dot, cmd, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.set_var(name, value, pipe)
            else:
                self.vars.append([name, value])
        return value

    def command(self, dot: Any, cmd: _Command, final: Any) -> Any:
        first = cmd.args[0]
        self.node = first
        self.step(first)
        t = type(first)
        if t is _Field:
            return self.field_chain(dot, dot, first, first.idents, cmd.args, final)
        if t is _Chain:
            return self.chain(dot, first, cmd.args, final)
        if t is _Identifier:
            return self.call(dot, first, cmd.args[1:], final, cmd)
        if t is _Pipe:
            self.not_a_function(cmd.args, final)
            return self.pipeline(dot, first)
        if t is _Variable:
            return self.variable(dot, first, cmd.args, final)
        self.not_a_function(cmd.args, final)
        if t is _Dot:
            return dot
        if t is _Nil:
            self.error("nil is not a command", first)
        return first.value

    def not_a_function(self, args: list, final: Any) -> None:
        if len(args) > 1 or final is not _MISSING:
            self.error(f"can't give argument to non-function {self.t.source(args[0])}", args[0])

    def variable(self, dot: Any, node: _Variable, args: list, final: Any) -> Any:
        value = self.var(node.name, node)
        if not node.idents:
            self.not_a_function(args, final)
            return value
        return self.field_chain(dot, value, node, node.idents, args, final, receiver_invalid_ok=True)

    def chain(self, dot: Any, node: _Chain, args: list, final: Any) -> Any:
        if isinstance(node.node, _Nil):
            self.error(f"indirection through explicit nil in {self.t.source(node)}", node)
        value = self.arg(dot, node.node)
        return self.field_chain(dot, value, node, node.idents, args, final, receiver_invalid_ok=True)

    def field_chain(self, dot: Any, receiver: Any, node: Any, idents: tuple, args: list, final: Any,
                    receiver_invalid_ok: bool = False) -> Any:
        last = len(idents) - 1
        for i, name in enumerate(idents):
            if receiver is None and i == 0 and receiver_invalid_ok:
                # Go: a variable or pipeline that holds nothing yields nothing (no error)
                return None
            has_args = i == last and (len(args) > 1 or final is not _MISSING)
            receiver = self.field(name, receiver, node, has_args)
        return receiver

    def field(self, name: str, receiver: Any, node: Any, has_args: bool) -> Any:
        if receiver is None:
            self.error(f"nil pointer evaluating interface {{}}.{name}", node)
        if isinstance(receiver, GoStruct):
            if name not in receiver.fields:
                self.error(f"can't evaluate field {name} in type {receiver.type_name}", node)
            if has_args:
                self.error(f"{name} has arguments but cannot be invoked as function", node)
            return receiver.fields[name]
        if isinstance(receiver, dict):
            if has_args:
                self.error(f"{name} is not a method but has arguments", node)
            try:
                return _check_value(receiver.get(name))
            except TypeError as e:
                self.error(str(e), node)
        self.error(f"can't evaluate field {name} in type {_type_name(receiver)}", node)

    def arg(self, dot: Any, node: Any) -> Any:
        """An argument's value (Go's evalArg for an ``interface{}``/``reflect.Value`` parameter)."""
        self.node = node
        t = type(node)
        if t is _Dot:
            return dot
        if t is _Nil:
            return None
        if t is _Field:
            return self.field_chain(dot, dot, node, node.idents, [node], _MISSING)
        if t is _Variable:
            return self.variable(dot, node, [node], _MISSING)
        if t is _Pipe:
            return self.pipeline(dot, node)
        if t is _Identifier:
            return self.call(dot, node, [], _MISSING)
        if t is _Chain:
            return self.chain(dot, node, [node], _MISSING)
        return node.value

    def call(self, dot: Any, ident: _Identifier, arg_nodes: list, final: Any, cmd: Any = None) -> Any:
        name = ident.name
        where = cmd if cmd is not None else ident
        n_args = len(arg_nodes) + (final is not _MISSING)
        if name in ("and", "or"):
            if n_args < 1:
                self.error(f"wrong number of args for {name}: want at least 1 got 0", ident)
            value = None
            for a in arg_nodes:
                value = self.arg(dot, a)
                if go_truth(value) == (name == "or"):
                    return value
            return final if final is not _MISSING else value
        args = [self.arg(dot, a) for a in arg_nodes]
        if final is not _MISSING:
            args.append(final)
        self.node = ident
        fn, min_args, max_args = _BUILTINS[name]
        if n_args < min_args or (max_args is not None and n_args > max_args):
            want = (f"{min_args}" if min_args == max_args else f"at least {min_args}" if max_args is None
                    else f"{min_args} to {max_args}")
            self.error(f"wrong number of args for {name}: want {want} got {n_args}", where)
        limit = self.limits.max_output_chars
        try:
            result = fn(*args, max_chars=limit) if name in _SIZED_BUILTINS else fn(*args)
        except OutputTooLongError:
            result = _MISSING
        except (_FuncError, TypeError) as e:
            self.error(f"error calling {name}: {e}", where)
        if result is _MISSING or isinstance(result, str) and len(result) > limit:
            # a function's result is bounded like the output (a variable could double it)
            self.t.exec_error(f"output longer than {limit} characters", where,
                              cls=GoTemplateLimitError)
        return result

    # printing ------------------------------------------------------------------------------
    def print_value(self, value: Any, node: _Action) -> None:
        if value is None:
            self.write("<no value>", node)
            return
        try:
            self.write(go_sprint_value(value), node)
        except TypeError as e:
            self.error(str(e), node)


# --------------------------------------------------------------------------------------------
# Builtin functions


class _FuncError(Exception):
    """A function's error (Go's ``error calling NAME: ...``)."""


def _fn_not(v: Any) -> bool:
    return not go_truth(v)


def _fn_len(v: Any) -> int:
    if v is None:
        raise _FuncError("len of nil pointer")
    if isinstance(v, str):
        return len(v.encode("utf-8", "surrogatepass"))
    if isinstance(v, (list, tuple, dict)):
        return len(v)
    raise _FuncError(f"len of type {_type_name(v)}")


def _index_arg(i: Any, cap: int) -> int:
    if i is None:
        raise _FuncError("cannot index slice/array with nil")
    if type(i) is not int:
        raise _FuncError(f"cannot index slice/array with type {_type_name(i)}")
    if i < 0 or i > cap:
        raise _FuncError(f"index out of range: {i}")
    return i


def _fn_index(item: Any, *indexes: Any) -> Any:
    if item is None:
        raise _FuncError("index of untyped nil")
    for i in indexes:
        if item is None:
            raise _FuncError("index of nil pointer")
        if isinstance(item, str):
            b = item.encode("utf-8", "surrogatepass")
            x = _index_arg(i, len(b))
            if x == len(b):
                raise _FuncError(f"index out of range: {x}")
            item = b[x]  # Go: a byte (uint8)
        elif isinstance(item, (list, tuple)):
            x = _index_arg(i, len(item))
            if x == len(item):
                raise _FuncError(f"index out of range: {x}")
            item = item[x]
        elif isinstance(item, dict):
            if not isinstance(i, str):
                raise _FuncError(f"value has type {_type_name(i)}; should be string")
            item = item.get(i)
        else:
            raise _FuncError(f"can't index item of type {_type_name(item)}")
    return _check_value(item)


def _fn_slice(item: Any, *indexes: Any) -> Any:
    if item is None:
        raise _FuncError("slice of untyped nil")
    if len(indexes) > 3:
        raise _FuncError(f"too many slice indexes: {len(indexes)}")
    if isinstance(item, str):
        if len(indexes) == 3:
            raise _FuncError("cannot 3-index slice a string")
        seq: Any = item.encode("utf-8", "surrogatepass")
    elif isinstance(item, (list, tuple)):
        seq = item
    else:
        raise _FuncError(f"can't slice item of type {_type_name(item)}")
    idx = [0, len(seq), len(seq)]
    for n, i in enumerate(indexes):
        idx[n] = _index_arg(i, len(seq))
    if idx[0] > idx[1]:
        raise _FuncError(f"invalid slice index: {idx[0]} > {idx[1]}")
    if len(indexes) == 3 and idx[1] > idx[2]:
        raise _FuncError(f"invalid slice index: {idx[1]} > {idx[2]}")
    part = seq[idx[0]:idx[1]]
    return part.decode("utf-8", "replace") if isinstance(item, str) else list(part)


def _fn_eq(a: Any, *others: Any) -> bool:
    if not others:
        raise _FuncError("missing argument for comparison")
    k1 = _basic_kind(a)
    for b in others:
        k2 = _basic_kind(b)
        if k1 != k2:
            if a is not None and b is not None:
                raise _FuncError("incompatible types for comparison")
            truth = False
        elif k1 is None:
            if a is None or b is None:
                truth = a is None and b is None
            else:
                raise _FuncError(f"non-comparable type {_type_name(a)}: {_type_name(b)}")
        else:
            truth = a == b
        if truth:
            return True
    return False


def _fn_ne(a: Any, b: Any) -> bool:
    return not _fn_eq(a, b)


def _compare(a: Any, b: Any) -> tuple[Any, Any]:
    k1, k2 = _basic_kind(a), _basic_kind(b)
    if k1 is None or k2 is None:
        raise _FuncError("invalid type for comparison")
    if k1 != k2:
        raise _FuncError("incompatible types for comparison")
    if k1 == "bool":
        raise _FuncError("invalid type for comparison")
    if k1 == "string":
        return a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    return a, b


def _fn_lt(a: Any, b: Any) -> bool:
    x, y = _compare(a, b)
    return x < y


def _fn_le(a: Any, b: Any) -> bool:
    return _fn_lt(a, b) or _fn_eq(a, b)


def _fn_gt(a: Any, b: Any) -> bool:
    return not _fn_le(a, b)


def _fn_ge(a: Any, b: Any) -> bool:
    return not _fn_lt(a, b)


def _fn_printf(fmt: Any, *args: Any, max_chars: int | None = None) -> str:
    if not isinstance(fmt, str):
        raise _FuncError(f"wrong type for value; expected string; got {_type_name(fmt)}")
    return go_sprintf(fmt, *args, max_chars=max_chars)


def _eval_args(args: tuple, max_chars: int | None = None) -> str:
    if len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return go_sprint(*args, max_chars=max_chars)


_HTML = {'"': "&#34;", "'": "&#39;", "&": "&amp;", "<": "&lt;", ">": "&gt;", "\0": "\ufffd"}


def _fn_html(*args: Any, max_chars: int | None = None) -> str:
    return "".join(_HTML.get(ch, ch) for ch in _eval_args(args, max_chars))


def _fn_js(*args: Any, max_chars: int | None = None) -> str:
    out = []
    for ch in _eval_args(args, max_chars):
        if ch == "\\":
            out.append("\\\\")
        elif ch in "'\"":
            out.append("\\" + ch)
        elif ch in "<>&=":
            out.append(f"\\u{ord(ch):04X}")
        elif ord(ch) < 0x80 and not _go_isprint(ch) or ord(ch) >= 0x80 and not _go_isprint(ch):
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return "".join(out)


def _fn_urlquery(*args: Any, max_chars: int | None = None) -> str:
    return urllib.parse.quote_plus(_eval_args(args, max_chars), safe="~")


def _fn_json(v: Any) -> str:
    return _json_or_empty(v)


def _date_args(args: tuple) -> None:
    for a in args:
        if not isinstance(a, str):
            raise _FuncError(f"wrong type for value; expected string; got {_type_name(a)}")


def _fn_current_date(*args: Any) -> str:
    _date_args(args)
    return date.today().isoformat()


def _fn_yesterday_date(*args: Any) -> str:
    _date_args(args)
    return (date.today() - timedelta(days=1)).isoformat()


def _fn_ts_type(v: Any) -> str:
    if isinstance(v, GoStruct) and v.ts_type is not None:
        return v.ts_type
    return "any"


#: Builtins that take ``max_chars``: they stop building a result that passes the output limit.
_SIZED_BUILTINS = frozenset({"printf", "print", "println", "html", "js", "urlquery"})

#: name -> (function, least arguments, most arguments or None)
_BUILTINS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "not": (_fn_not, 1, 1), "len": (_fn_len, 1, 1), "index": (_fn_index, 1, None),
    "slice": (_fn_slice, 1, None), "eq": (_fn_eq, 1, None), "ne": (_fn_ne, 2, 2),
    "lt": (_fn_lt, 2, 2), "le": (_fn_le, 2, 2), "gt": (_fn_gt, 2, 2), "ge": (_fn_ge, 2, 2),
    "print": (go_sprint, 0, None), "println": (go_sprintln, 0, None), "printf": (_fn_printf, 1, None),
    "html": (_fn_html, 0, None), "js": (_fn_js, 0, None), "urlquery": (_fn_urlquery, 0, None),
    "json": (_fn_json, 1, 1), "currentDate": (_fn_current_date, 0, None),
    "yesterdayDate": (_fn_yesterday_date, 0, None), "toTypeScriptType": (_fn_ts_type, 1, 1),
}


# --------------------------------------------------------------------------------------------
# The template


class GoTemplate:
    """A parsed Go text/template.

    ``GoTemplate(text)`` parses (raising :class:`GoTemplateSyntaxError`); :meth:`execute`
    renders it for one data value. A template is immutable after parsing and may be executed
    from several threads at once.

    Attributes:
        text: the template source.
        root: the main template's tree.
        definitions: ``{{ define }}``/``{{ block }}`` name -> tree.
    """

    def __init__(self, text: str, name: str = ""):
        self.text, self.name = text, name
        self.definitions: dict[str, _List] = {}
        items = _Lexer(text, self).run()
        self.root = _Parser(self, items).parse()

    # positions and errors ------------------------------------------------------------------
    def position(self, pos: int) -> tuple[int, int]:
        """1-based (line, column) of character offset ``pos``."""
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return line, col

    def source(self, node: Any) -> str:
        """The template text of an expression node (Go's ``node.String()``)."""
        return _node_text(node)

    def syntax_error(self, msg: str, pos: int) -> None:
        line, col = self.position(pos)
        raise GoTemplateSyntaxError(f"template: {self.name}:{line}:{col}: {msg}", line=line, col=col,
                                    construct=self.text[pos:pos + 20].split("}}")[0])

    def exec_error(self, msg: str, node: Any, cls: type = GoTemplateExecError) -> None:
        pos = getattr(node, "pos", 0) if isinstance(node, _Node) else 0
        line, col = self.position(pos)
        construct = _node_text(node) if node is not None else ""
        raise cls(f'template: {self.name}:{line}:{col}: executing "{self.name}" at <{construct}>: {msg}',
                  line=line, col=col, construct=construct)

    def add_definition(self, name: str, body: _List, pos: int) -> None:
        if name in self.definitions and self.definitions[name].nodes and body.nodes:
            self.syntax_error(f"template: multiple definition of template {name!r}", pos)
        if name not in self.definitions or body.nodes:
            self.definitions[name] = body

    # running -------------------------------------------------------------------------------
    def execute(self, data: Any, limits: RenderLimits = RenderLimits(), *, root: _List | None = None) -> str:
        """Render for ``data`` (the value of ``.`` and ``$``).

        Args:
            data: plain template values (see the module docstring).
            limits: bounds on the output and the work.
            root: a tree to run instead of :attr:`root` (Ollama's cut templates).

        Raises:
            GoTemplateExecError: what Go's ``Execute`` would return, and values it cannot print.
            GoTemplateLimitError: a limit was passed.
        """
        state = _State(self, limits)
        state.vars = [["$", data]]
        try:
            state.walk(data, self.root if root is None else root)
        except RecursionError:
            self.exec_error("template nested too deeply", state.node, cls=GoTemplateLimitError)
        return "".join(state.out)

    def identifiers(self) -> list[str]:
        """Ollama's ``Template.Vars``: every field and variable name its pipelines use, in all
        of its templates, lower-cased, sorted, unique. Raises GoTemplateSyntaxError for a
        ``{{ template }}`` without a pipeline (Ollama: ``undefined template specified``)."""
        names: set[str] = set()
        for tree in [self.root, *self.definitions.values()]:
            for n in _walk_nodes(tree):
                if isinstance(n, _TemplateCall) and n.pipe is None:
                    self.syntax_error("undefined template specified", n.pos)
                if isinstance(n, _Field):
                    names.update(i.lower() for i in n.idents)
                elif isinstance(n, _Variable):
                    names.update(i.lower() for i in (n.name, *n.idents))
        return sorted(names)


def _walk_nodes(node: Any) -> Iterable[Any]:
    """Nodes as Ollama's ``Identifiers`` visits them: lists, branches (pipeline and bodies),
    actions, template calls, pipelines' command arguments (parenthesised pipelines too)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, _List):
            stack.extend(reversed(n.nodes))
        elif isinstance(n, _Branch):
            stack.extend(x for x in (n.else_body, n.body, n.pipe) if x is not None)
        elif isinstance(n, (_Action, _TemplateCall)):
            if n.pipe is not None:
                stack.append(n.pipe)
        elif isinstance(n, _Pipe):
            for cmd in reversed(n.cmds):
                stack.extend(reversed(cmd.args))


def _node_text(node: Any) -> str:
    """A node as template text (close to Go's ``Node.String()``)."""
    t = type(node)
    if t is _Field:
        return "".join("." + i for i in node.idents)
    if t is _Variable:
        return node.name + "".join("." + i for i in node.idents)
    if t is _Chain:
        return f"({_node_text(node.node)})" + "".join("." + i for i in node.idents) \
            if isinstance(node.node, _Pipe) else _node_text(node.node) + "".join("." + i for i in node.idents)
    if t is _Identifier:
        return node.name
    if t is _Dot:
        return "."
    if t is _Nil:
        return "nil"
    if t is _Const:
        return node.text
    if t is _Command:
        return " ".join(_node_text(a) if not isinstance(a, _Pipe) else f"({_node_text(a)})" for a in node.args)
    if t is _Pipe:
        decl = ""
        if node.decl:
            decl = ", ".join(node.decl) + (" = " if node.is_assign else " := ")
        return decl + " | ".join(_node_text(c) for c in node.cmds)
    if t is _Action:
        return "{{" + _node_text(node.pipe) + "}}"
    if t is _Branch:
        return "{{" + node.kind + " " + _node_text(node.pipe) + "}}"
    if t is _TemplateCall:
        return f'{{{{template "{node.name}"}}}}'
    if t is _Break:
        return "{{break}}"
    if t is _Continue:
        return "{{continue}}"
    if t is _Text:
        return node.text[:20]
    return ""


# --------------------------------------------------------------------------------------------
# Ollama: the values it passes and how it executes a TEMPLATE layer


def _cut_after_response(root: _List) -> _List:
    """Ollama's ``deleteNode`` for the last turn: keep the tree up to the first ``.Response``
    field (visiting lists, branch bodies (not their conditions), actions, pipelines and their
    arguments in order) and drop every node visited after it."""
    cut = False

    def walk(n: Any) -> Any:
        nonlocal cut
        if isinstance(n, _Field) and "Response" in n.idents:
            cut = True
            return n
        if cut:
            return None
        if isinstance(n, _List):
            return _List(n.pos, [m for m in (walk(c) for c in n.nodes) if m is not None])
        if isinstance(n, _Branch):
            body = walk(n.body)
            else_body = walk(n.else_body) if n.else_body is not None else None
            return _Branch(n.pos, n.kind, n.pipe, body if body is not None else _List(n.pos, []), else_body)
        if isinstance(n, _Action):
            pipe = walk(n.pipe)
            return None if pipe is None else _Action(n.pos, pipe)
        if isinstance(n, _Pipe):
            cmds = []
            for c in n.cmds:
                args = [m for m in (walk(a) for a in c.args) if m is not None]
                if not args:
                    return None
                cmds.append(_Command(c.pos, args))
            return _Pipe(n.pos, n.decl, n.is_assign, cmds) if cmds else None
        return n

    return walk(root)


_RESPONSE_ACTION = _Action(-1, _Pipe(-1, [], False, [_Command(-1, [_Field(-1, ("Response",))])]))


class OllamaTemplate:
    """An Ollama TEMPLATE layer: Go template text run the way Ollama's ``template.Template`` runs it.

    Parsing follows ``template.Parse``: the text must parse, and a template whose identifiers
    include neither ``messages`` nor ``response`` gets ``{{ .Response }}`` appended.
    :meth:`render` follows ``Template.Execute``.

    Raises:
        GoTemplateSyntaxError: from the constructor, for text that does not parse or uses what
            this renderer refuses (Ollama: ``template error: ...`` at create, 400).
    """

    def __init__(self, text: str):
        self.text = text
        self.template = GoTemplate(text)
        self.vars = self.template.identifiers()
        self.root = self.template.root
        if "messages" not in self.vars and "response" not in self.vars:
            self.root = _List(0, [*self.root.nodes, _RESPONSE_ACTION])
        self._last_turn: _List | None = None

    @property
    def uses_messages(self) -> bool:
        """The template ranges over ``.Messages`` (the whole conversation in one execution)."""
        return "messages" in self.vars

    def render(self, messages: list[dict] | None = None, tools: list[dict] | None = None,
               think: bool | str | None = None, *, prompt: str = "", suffix: str = "",
               limits: RenderLimits = RenderLimits()) -> str:
        """The prompt text, as Ollama's ``Template.Execute(Values{...})`` renders it.

        Args:
            messages: the chat (OpenAI-style or Ollama-style dicts, see :func:`template_messages`),
                model MESSAGE/SYSTEM already merged in (:func:`merge_model_messages`).
            tools: OpenAI/Ollama tool definitions (see :func:`template_tools`).
            think: the request's ``think`` (None: not set; a bool; or "high"/"medium"/"low"/"max").
            prompt, suffix: both set: a fill-in-the-middle request (``/api/generate`` with
                ``suffix``): the template gets ``Prompt``, ``Suffix``, ``Response`` only.
            limits: execution bounds.

        Raises:
            GoTemplateExecError: the template failed on these values.
            InvalidInputError: a message cannot be converted (see :func:`template_messages`).
        """
        think_values = _think_values(think)
        if prompt and suffix:
            data = {"Prompt": prompt, "Suffix": suffix, "Response": "", **think_values}
            return self.template.execute(data, limits, root=self.root)
        msgs = template_messages(messages or [])
        system, collated = collate(msgs)
        if self.uses_messages:
            data = {"System": system, "Messages": [_message_struct(m) for m in collated],
                    "Tools": template_tools(tools), "Response": "", **think_values}
            return self.template.execute(data, limits, root=self.root)
        return self._render_turns(collated, think_values, limits)

    def _render_turns(self, msgs: list[dict], think_values: dict, limits: RenderLimits) -> str:
        """Older templates: one execution per (system, prompt, response) turn; the last one runs
        a copy of the template cut after ``.Response``."""
        out: list[str] = []
        turn = {"System": "", "Prompt": "", "Response": ""}

        def execute(root: _List) -> None:
            data = {**turn, **think_values}
            out.append(self.template.execute(data, limits, root=root))
            turn.update(System="", Prompt="", Response="")

        for m in msgs:
            role = m["role"]
            if role == "system":
                if turn["Prompt"] or turn["Response"]:
                    execute(self.root)
                turn["System"] = m["content"]
            elif role == "user":
                if turn["Response"]:
                    execute(self.root)
                turn["Prompt"] = m["content"]
            elif role == "assistant":
                turn["Response"] = m["content"]
        if self._last_turn is None:
            self._last_turn = _cut_after_response(self.root)
        execute(self._last_turn)
        return "".join(out)


def _think_values(think: bool | str | None) -> dict:
    """Ollama's Think, ThinkLevel and IsThinkSet from a request's ``think`` (api.ThinkValue)."""
    if think is None:
        return {"Think": False, "ThinkLevel": "", "IsThinkSet": False}
    if isinstance(think, bool):
        return {"Think": think, "ThinkLevel": "medium" if think else "", "IsThinkSet": True}
    if isinstance(think, str):
        return {"Think": think in ("high", "medium", "low", "max"), "ThinkLevel": think, "IsThinkSet": True}
    raise InvalidInputError(f"think must be a boolean or a string, not {type(think).__name__}")


def merge_model_messages(messages: list[dict], system: str = "",
                         model_messages: list[dict] | None = None) -> list[dict]:
    """The conversation Ollama's /api/chat renders: the model's MESSAGE layer, then the
    request's messages, with the model's SYSTEM first unless the request starts with a system
    message (``server/routes.go`` ChatHandler)."""
    msgs = [*(model_messages or []), *messages]
    if messages and messages[0].get("role") != "system" and system:
        msgs = [{"role": "system", "content": system}, *msgs]
    return msgs


def collate(msgs: list[dict]) -> tuple[str, list[dict]]:
    """Ollama's ``collate``: all system contents joined by a blank line, and the messages with
    consecutive ones of the same role merged (contents joined by a blank line; the first
    message's other fields kept), except tool messages. Input: :func:`template_messages` dicts."""
    system = [m["content"] for m in msgs if m["role"] == "system"]
    out: list[dict] = []
    for m in msgs:
        if out and out[-1]["role"] == m["role"] and m["role"] != "tool":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    return "\n\n".join(system), out


def _go_numbers(v: Any) -> Any:
    """JSON data as Go's ``json.Unmarshal`` into ``any`` holds it: numbers are float64."""
    if type(v) is int:
        return float(v)
    if isinstance(v, dict):
        return {str(k): _go_numbers(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_go_numbers(x) for x in v]
    if v is None or type(v) in (bool, float, str):
        return v
    raise InvalidInputError(f"unsupported JSON value of type {type(v).__name__}")


def _tool_calls(calls: Any) -> list[dict]:
    import json as _json

    out = []
    for tc in calls or []:
        if not isinstance(tc, dict):
            raise InvalidInputError("invalid tool call")
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = _json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the stack
                raise InvalidInputError("invalid tool call arguments") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise InvalidInputError("invalid tool call arguments")
        index = fn.get("index", tc.get("index", 0))
        out.append({"id": str(tc.get("id") or ""), "function": {
            "index": index if type(index) is int else 0, "name": str(fn.get("name") or ""),
            "arguments": _go_numbers(args)}})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as Ollama's ``api.Message`` holds them, from OpenAI-style or Ollama-style
    dicts (what ``openai.FromChatRequest`` and /api/chat's JSON decoding produce).

    Each result has ``role`` (lower-cased), ``content``, ``thinking`` (from ``thinking``,
    ``reasoning`` or ``reasoning_content``), ``tool_calls`` (``[{"id", "function": {"index",
    "name", "arguments": dict}}]``; OpenAI's JSON-string arguments are decoded, numbers become
    floats as in Go), ``tool_name`` (a tool message's ``tool_name`` or ``name``, else the name of
    the call its ``tool_call_id`` answers, looked up from the last message backwards) and
    ``tool_call_id``. A content list becomes one message per text part (Ollama does the same;
    :func:`collate` then joins them).

    Raises:
        InvalidInputError: an image or audio part (``vision is not supported``), a part of
            another type, content that is neither text nor a list (unless tool calls are given),
            tool call arguments that are not a JSON object.
    """
    out: list[dict] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise InvalidInputError("invalid message format")
        role = str(msg.get("role") or "").lower()
        thinking = msg.get("thinking") or msg.get("reasoning") or msg.get("reasoning_content") or ""
        tool_name = ""
        if role == "tool":
            tool_name = msg.get("tool_name") or msg.get("name") or _name_for_call(messages, msg.get("tool_call_id"))
        base = {"role": role, "content": "", "thinking": str(thinking),
                "tool_calls": _tool_calls(msg.get("tool_calls")), "tool_name": str(tool_name or ""),
                "tool_call_id": str(msg.get("tool_call_id") or "")}
        content = msg.get("content")
        if msg.get("images"):
            raise InvalidInputError("vision is not supported")
        if isinstance(content, str):
            out.append({**base, "content": content})
        elif isinstance(content, list):
            out.extend(_content_parts(content, base))
        elif content is None and base["tool_calls"]:
            out.append(base)
        else:
            raise InvalidInputError(f"invalid message content type: {_type_name(content)}")
    return out


def _content_parts(parts: list, base: dict) -> list[dict]:
    out = []
    for part in parts:
        if not isinstance(part, dict):
            raise InvalidInputError("invalid message format")
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            out.append({"role": base["role"], "content": part["text"], "thinking": "", "tool_calls": [],
                        "tool_name": "", "tool_call_id": ""})
        elif part.get("type") in ("image_url", "input_audio", "image"):
            raise InvalidInputError("vision is not supported")
        else:
            raise InvalidInputError("invalid message format")
    if out and (base["tool_calls"] or base["thinking"]):
        out[-1].update(tool_calls=base["tool_calls"], tool_name=base["tool_name"],
                       tool_call_id=base["tool_call_id"], thinking=base["thinking"])
    return out


def _name_for_call(messages: list[dict], call_id: Any) -> str:
    if not call_id:
        return ""
    for m in reversed(messages):
        for tc in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            if isinstance(tc, dict) and tc.get("id") == call_id:
                return str((tc.get("function") or {}).get("name") or "")
    return ""


def _message_struct(m: dict) -> GoStruct:
    """Ollama's ``*template.templateMessage`` for one :func:`template_messages` dict."""
    calls = GoList([_tool_call_struct(tc) for tc in m["tool_calls"]], nil=not m["tool_calls"])
    return GoStruct("*template.templateMessage", {
        "Role": m["role"], "Content": m["content"], "Thinking": m["thinking"],
        "Images": GoList(nil=True), "ToolCalls": calls, "ToolName": m["tool_name"],
        "ToolCallID": m["tool_call_id"]})


def _tool_call_struct(tc: dict) -> GoStruct:
    fn = tc["function"]
    args = GoMap(fn["arguments"], stringer=True)
    function = GoStruct("template.templateToolCallFunction",
                        {"Index": fn["index"], "Name": fn["name"], "Arguments": args})
    return GoStruct("template.templateToolCall", {"ID": tc["id"], "Function": function})


def template_tools(tools: list[dict] | None) -> GoList:
    """Ollama's ``templateTools`` for OpenAI/Ollama tool definitions: ``.Type``, ``.Items``,
    ``.Function.Name``, ``.Function.Description``, ``.Function.Parameters.Type``/``.Defs``/
    ``.Items``/``.Required``/``.Properties`` (a map of name -> ``api.ToolProperty`` with
    ``.Type``, ``.Description``, ``.Enum``, ``.Items``, ``.AnyOf``, ``.Properties``,
    ``.Required``). Printed or passed to ``json`` they are Ollama's JSON: struct fields in
    Ollama's order, schema keywords that ``api.ToolProperty`` lacks (``default``, ``minimum``...)
    dropped, top-level properties in sorted order, nested ones in the given order. ``None``
    gives Ollama's nil list (false, prints ``null``).

    Raises:
        InvalidInputError: a tool or schema that is not an object.
    """
    if tools is None:
        return GoList(nil=True, stringer=True)
    return GoList([_tool_struct(t) for t in tools], stringer=True)


def _tool_struct(tool: Any) -> GoStruct:
    if not isinstance(tool, dict):
        raise InvalidInputError("invalid tool definition")
    fn = tool.get("function") or {}
    params = fn.get("parameters") or {} if isinstance(fn, dict) else None
    if not isinstance(params, dict):
        raise InvalidInputError("invalid tool definition")
    props_in = params.get("properties")
    props = GoMap({str(k): _property(v) for k, v in props_in.items()} if isinstance(props_in, dict) else {},
                  nil=not isinstance(props_in, dict), stringer=True)
    required = _strings(params.get("required"))
    defs, items = _go_numbers(params.get("$defs")), _go_numbers(params.get("items"))
    p_json = JsonObject([("type", str(params.get("type") or "")),
                         *([("$defs", defs)] if defs is not None else []),
                         *([("items", items)] if items is not None else []),
                         *([("required", required)] if required else []),
                         ("properties", props)])
    parameters = GoStruct("template.templateToolFunctionParameters", {
        "Type": str(params.get("type") or ""), "Defs": defs, "Items": items,
        "Required": GoList(required, nil=not required), "Properties": props}, json=p_json)
    name, desc = str(fn.get("name") or ""), str(fn.get("description") or "")
    function = GoStruct("template.templateToolFunction",
                        {"Name": name, "Description": desc, "Parameters": parameters},
                        json=JsonObject([("name", name), ("description", desc), ("parameters", parameters)]))
    t_items = _go_numbers(tool.get("items"))
    t_type = str(tool.get("type") or "")
    return GoStruct("template.templateTool", {"Type": t_type, "Items": t_items, "Function": function},
                    json=JsonObject([("type", t_type), *([("items", t_items)] if t_items is not None else []),
                                     ("function", function)]), stringer=True)


def _strings(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


_TS_TYPES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
             "array": "any[]", "object": "Record<string, any>", "null": "null"}


def _property(schema: Any, depth: int = 0) -> GoStruct:
    """Ollama's ``api.ToolProperty`` for a JSON schema."""
    if not isinstance(schema, dict) or depth > 64:
        raise InvalidInputError("invalid tool parameter schema")
    any_of = [_property(s, depth + 1) for s in schema.get("anyOf") or []]
    t = schema.get("type")
    ptype = PropertyType([t] if isinstance(t, str) else _strings(t))
    items = _go_numbers(schema.get("items"))
    desc = str(schema.get("description") or "")
    enum = _go_numbers(schema.get("enum")) if isinstance(schema.get("enum"), list) else []
    nested = schema.get("properties")
    nested_json = JsonObject((str(k), _property(v, depth + 1)) for k, v in nested.items()) \
        if isinstance(nested, dict) else None
    nested_val = GoStruct("*api.ToolPropertiesMap", {}, json=nested_json) if nested_json is not None else None
    required = _strings(schema.get("required"))
    js = JsonObject([*([("anyOf", any_of)] if any_of else []), *([("type", ptype)] if ptype else []),
                     *([("items", items)] if items is not None else []),
                     *([("description", desc)] if desc else []), *([("enum", enum)] if enum else []),
                     *([("properties", nested_json)] if nested_json is not None else []),
                     *([("required", required)] if required else [])])
    if any_of:
        ts = " | ".join(p.ts_type for p in any_of)
    elif not ptype:
        ts = "any"
    else:
        ts = " | ".join(_TS_TYPES.get(x, "any") for x in ptype)
    return GoStruct("api.ToolProperty", {
        "AnyOf": GoList(any_of, nil=not any_of), "Type": ptype, "Items": items, "Description": desc,
        "Enum": GoList(enum, nil=not enum), "Properties": nested_val,
        "Required": GoList(required, nil=not required)}, json=js, ts_type=ts)


def chat_values(messages: list[dict], tools: list[dict] | None = None,
                think: bool | str | None = None) -> dict:
    """The values Ollama passes a template that names ``.Messages``: ``System`` (all system
    contents joined by a blank line), ``Messages`` (collated :class:`GoStruct` messages with
    ``.Role .Content .Thinking .Images .ToolCalls .ToolName .ToolCallID``), ``Tools``
    (:func:`template_tools`), ``Response`` (""), ``Think``, ``ThinkLevel``, ``IsThinkSet``.
    ``messages`` as for :func:`template_messages`."""
    system, collated = collate(template_messages(messages))
    return {"System": system, "Messages": [_message_struct(m) for m in collated],
            "Tools": template_tools(tools), "Response": "", **_think_values(think)}
