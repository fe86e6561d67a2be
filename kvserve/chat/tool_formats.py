"""Tool-call formats of more model families (registered in :mod:`kvserve.chat.tool_calls`).

Each parser follows the vLLM parser of the same ``--tool-call-parser`` name for the format
and its edge cases (our own code). Shared rules (content before the first call, arguments
re-serialized as ``json.dumps(..., ensure_ascii=False)`` writes them, malformed calls ->
all content, streaming) are those of :mod:`kvserve.chat.tool_calls`; differences are noted
per format. All of these send each call whole once it closed and parsed (in both streaming
modes), so a stream's calls equal :meth:`ToolParser.extract`'s.

``qwen3_coder`` / ``qwen3_xml`` (Qwen3-Coder, Qwen3.5)
    ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``.
    One newline after ``>`` and one before ``</parameter>`` are removed from VALUE. A
    ``</parameter>`` ends the value only when what follows (after whitespace) is another
    ``<parameter=``, ``</function>``, ``</tool_call>`` or the end, so values may contain the
    tag (a ``<parameter=`` on a new line before it opens a nested literal pair); a missing
    ``</parameter>`` ends at the next ``<parameter=`` on a new line naming another schema
    parameter (any name when the tool has no schema) or at ``</function>``. Parameters need no
    newline between them. Values are converted by the tool's JSON schema type (vLLM's
    ``_convert_param_value``): ``string`` (and unknown parameters) stay text (an ``enum`` value
    with whitespace around it loses the whitespace: kvserve's rule); ``integer`` ->
    int, ``number`` -> int when integral else float, ``boolean`` -> ``value.lower() ==
    "true"``, ``object``/``array`` -> JSON (else a Python literal), other types a Python literal;
    ``null``/``None`` -> null for non-string types and for nullable ones; a value that does not
    convert stays text. A function name with ``{}<>"'`` or whitespace is not a call (an
    unrendered template). vLLM also takes a bare ``<function=...>`` without ``<tool_call>``;
    kvserve needs the ``<tool_call>`` tag.
``glm45`` / ``glm47`` (GLM-4.5/4.6/4.7)
    ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`` (4.7 writes
    no newline after NAME). Keys and values are stripped; a value whose schema type is
    ``string`` stays text, others are parsed as JSON, else as a Python literal, else text.
``kimi_k2`` (Kimi K2)
    ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
    (also the singular ``<|tool_call_section_begin|>``). The call id is the model's
    ``functions.NAME:0`` (vLLM does the same); NAME is the part before ``:`` after the last ``.``.
    vLLM passes the argument text on as the model wrote it; here it must be a JSON object and
    is re-serialized (the shared rule), as for ``deepseek_v3``/``deepseek_v31``.
``deepseek_v3`` (DeepSeek V3 / R1)
    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``.
``deepseek_v31`` (DeepSeek V3.1)
    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``.
``seed_oss`` (Seed-OSS)
    ``qwen3_coder``'s format inside ``<seed:tool_call>`` ... ``</seed:tool_call>``.
``minimax_m2`` (MiniMax-M2)
    ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>...</minimax:tool_call>``
    (several invokes per block; names may be quoted with ``"`` or ``'``); values stripped and
    converted as vLLM: ``null``/``none``/``nil`` -> null, then the first schema type that converts
    in the order integer, number, boolean (``true/1/yes/on`` / ``false/0/no/off``), object/array
    (JSON), string; a parameter not in the schema stays text. An ``<invoke>`` without
    ``</invoke>`` is dropped.
``mimo`` (MiMo)
    ``qwen3_coder``'s format (vLLM registers the same parser).
``granite4`` (Granite 4.0)
    ``hermes``'s ``<tool_call>{...}</tool_call>``; the text before, between and after the calls
    is the content (vLLM joins it; here whitespace-only pieces are dropped).
``phi4_mini_json`` (Phi-4-mini)
    ``functools[{"name": ..., "arguments"|"parameters": {...}}, ...]``; text after the array is
    dropped. vLLM returns no content at all; here the text before ``functools[`` is content.
``longcat`` (LongCat-Flash)
    ``hermes`` in ``<longcat_tool_call>`` ... ``</longcat_tool_call>`` tags.
``granite`` (Granite 3.x)
    The whole output (after whitespace) is ``[{"name": ..., "arguments": {...}}, ...]``, optionally
    after ``<|tool_call|>`` (3.0) or ``<tool_call>`` (3.1); content is then ``None``. Text after
    the array makes the output malformed (vLLM ``json.loads``es the rest).
``llama4_pythonic`` / ``llama4_json``
    The ``pythonic`` and ``llama3_json`` formats under Llama 4's names (vLLM registers the same).
``openai`` (gpt-oss, harmony)
    Messages ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
    are calls (arguments re-serialized when they are JSON, else passed as text, as vLLM);
    ``final`` and recipient-less ``commentary`` (preamble) messages are content; ``analysis`` is
    not content (the ``openai_gptoss`` reasoning parser returns it as reasoning). Text before
    the first harmony marker is content (what the reasoning split leaves). A call message cut
    off at the end of the text counts when its JSON is complete (``<|call|>`` is a stop token
    and often not in the text). Content is the preambles and the final message in order (vLLM
    prefers the final message when both exist).

Special tokens: the markers of ``kimi_k2``, ``deepseek_v3``/``v31`` and ``openai`` are added or
control tokens of those vocabularies. Parsing needs them in the decoded text; control tokens
are rendered only when the detokenizer is asked to (``ToolParser.marker_texts`` lists what a
parser needs).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Callable

from kvserve.chat.harmony import HarmonyParser
from kvserve.chat.tool_calls import (
    _MALFORMED_MSG,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    ToolCall,
    ToolParser,
    _CallObject,
    _canonical_args,
    _dump,
    _End,
    _Event,
    _HermesRegion,
    _whole,
    _jsonable,
    _json_loads,
    _loads,
    _Malformed,
    _Obj,
    _Region,
    _Start,
)
from kvserve.engine.detokenizer import partial_suffix

__all__ = [
    "NEW_TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "Glm45ToolParser",
    "Granite4ToolParser",
    "GraniteToolParser",
    "HarmonyToolParser",
    "KimiK2ToolParser",
    "Llama4JsonToolParser",
    "Llama4PythonicToolParser",
    "LongcatToolParser",
    "MimoToolParser",
    "MinimaxM2ToolParser",
    "Phi4MiniJsonToolParser",
    "Qwen3CoderToolParser",
    "SeedOssToolParser",
    "convert_param_value",
    "minimax_value",
    "tool_properties",
]

logger = logging.getLogger(__name__)
_WS = " \t\n\r"
_NON_WS = re.compile(r"[^ \t\n\r]")


def tool_properties(tools: list[dict], name: str) -> dict:
    """The ``parameters.properties`` of the tool called ``name`` in OpenAI ``tools`` ({} if none)."""
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _schema_type(schema: object) -> tuple[str, bool]:
    """(primary type, allows null) of a property schema."""
    if not isinstance(schema, dict):
        return "string", False
    t = schema.get("type")
    if isinstance(t, list):
        types = [str(x).strip().lower() for x in t]
        rest = [x for x in types if x != "null"]
        return (rest[0] if rest else "null"), "null" in types
    if t is not None:
        t = str(t).strip().lower()
        return t, t == "null"
    if isinstance(schema.get("anyOf"), list):
        primary, null = "string", False
        picked = False
        for opt in schema["anyOf"]:
            if isinstance(opt, dict) and "type" in opt:
                ot = str(opt["type"]).strip().lower()
                if ot == "null":
                    null = True
                elif not picked:
                    primary, picked = ot, True
        return primary, null
    return "string", False


def _literal(text: str) -> tuple[bool, object]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def convert_param_value(value: str, name: str, props: dict) -> object:
    """A ``qwen3_coder`` parameter's text -> its JSON value by the schema (vLLM's rules; see the
    module docstring). Never raises: what does not convert stays text."""
    if name not in props:
        return value
    ptype, nullable = _schema_type(props[name])
    low = value.lower()
    if nullable and low in ("null", "none"):
        return None
    if ptype in ("string", "str", "text", "varchar", "char", "enum"):
        schema = props[name]
        if isinstance(schema, dict) and ("enum" in schema or "const" in schema) and value.strip() != value:
            allowed = schema.get("enum") or [schema.get("const")]
            if value not in allowed and value.strip() in allowed:
                return value.strip()  # whitespace around an enum value (a forced call may write it)
        return value
    if low in ("null", "none"):
        return None
    if ptype.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if ptype.startswith(("num", "float")):
        try:
            f = float(value)
            return int(f) if f.is_integer() else f
        except (ValueError, OverflowError):
            return value
    if ptype in ("boolean", "bool", "binary"):
        return low == "true"
    container = ptype in ("object", "array", "arr") or ptype.startswith(("dict", "list"))
    if container:
        try:
            v = _json_loads(value)
        except ValueError:
            pass
        else:
            if isinstance(v, str):
                ok, lv = _literal(v)
                if ok:
                    v = lv
            return v
    ok, v = _literal(value)
    if not ok:
        return value
    if container and isinstance(v, str):
        ok, lv = _literal(v)
        if ok:
            v = lv
    return v


def _args_json(pairs: dict) -> str:
    try:
        return _dump(_Obj((k, _jsonable(v)) for k, v in pairs.items()))
    except _Malformed:
        raise
    except (TypeError, ValueError) as e:
        raise _Malformed("argument is not a JSON value") from e


# ---------------------------------------------------------------------------------------------
# Block regions: calls between an open and a close marker, each parsed whole
# ---------------------------------------------------------------------------------------------


class _BlockRegion(_Region):
    """Calls ``OPEN body CLOSE``; text outside calls is dropped; ``parse(body)`` -> events.

    An unterminated last call is parsed at :meth:`finish` from what is there.
    """

    OPEN: tuple[str, ...] = ()
    CLOSE = ""

    def __init__(self, parse: Callable[[str], list[_Event]]) -> None:
        self._parse = parse
        self._buf = ""
        self._in = False
        self._calls = 0
        #: where the search for the close marker resumes in ``_buf`` (earlier text was scanned
        #: already): each character is looked at a bounded number of times, a stream stays linear
        self._scan = 0

    def _find_close(self, buf: str) -> int:
        j = buf.find(self.CLOSE, self._scan)
        if j < 0:
            self._scan = max(0, len(buf) - len(self.CLOSE) + 1)
        return j

    def feed(self, text: str) -> list[_Event]:
        buf, self._buf = self._buf, ""
        buf += text  # a local with one reference: CPython grows it in place (no copy per delta)
        self._buf = buf
        del buf
        events: list[_Event] = []
        while True:
            if not self._in:
                best, mlen = -1, 0
                for m in self.OPEN:
                    i = self._buf.find(m)
                    if i >= 0 and (best < 0 or i < best):
                        best, mlen = i, len(m)
                if best < 0:
                    k = max(partial_suffix(self._buf, m) for m in self.OPEN)
                    self._buf = self._buf[len(self._buf) - k:] if k else ""
                    return events
                self._buf, self._in, self._scan = self._buf[best + mlen:], True, 0
            j = self._find_close(self._buf)
            if j < 0:
                return events
            body, self._buf, self._in, self._scan = self._buf[:j], self._buf[j + len(self.CLOSE):], False, 0
            events += self._one(body)

    def _one(self, body: str) -> list[_Event]:
        events = self._parse(body)
        self._calls += 1
        return events

    def finish(self) -> list[_Event]:
        events: list[_Event] = []
        if self._in:
            self._in = False
            events = self._one(self._buf)
        self._buf = ""
        if not self._calls:
            raise _Malformed("no complete tool call")
        return events


class _TagRegion(_BlockRegion):
    def __init__(self, open_: tuple[str, ...], close: str, parse: Callable[[str], list[_Event]]) -> None:
        super().__init__(parse)
        self.OPEN, self.CLOSE = open_, close


class _Qwen3Region(_BlockRegion):
    """``<tool_call>`` blocks whose ``</tool_call>`` is structural (followed by whitespace and
    another ``<tool_call>`` or the end; while streaming, held until that is known)."""

    OPEN, CLOSE = ("<tool_call>",), "</tool_call>"

    def __init__(self, parse: Callable[[str], list[_Event]]) -> None:
        super().__init__(parse)
        self._final = False

    def _find_close(self, buf: str) -> int:
        # resumes at self._scan: a close followed by other text was decided (not structural) and
        # is not looked at again, so a value full of literal </tool_call> streams in linear time
        pos, opener = self._scan, self.OPEN[0]
        while True:
            j = buf.find(self.CLOSE, pos)
            if j < 0:
                self._scan = max(pos, len(buf) - len(self.CLOSE) + 1)
                # at the end, the last close stands when none is structural (text after the calls)
                return buf.rfind(self.CLOSE) if self._final else -1
            m = _NON_WS.search(buf, j + len(self.CLOSE))
            k = m.start() if m else len(buf)
            if buf.startswith(opener, k):
                return j
            if k == len(buf) or (len(buf) - k < len(opener) and opener.startswith(buf[k:])):
                self._scan = j
                if self._final:
                    return j
                return -1  # undecided until more text (or the end) comes
            pos = j + 1  # other text follows: a literal </tool_call> inside a value, or trailing text

    def finish(self) -> list[_Event]:
        self._final = True
        events: list[_Event] = []
        while self._in:
            j = self._find_close(self._buf)
            if j < 0:
                break
            body, self._buf, self._in, self._scan = self._buf[:j], self._buf[j + len(self.CLOSE):], False, 0
            events += self._one(body)
            events += self.feed("")  # a next <tool_call> in the rest
        return events + super().finish()


# ---------------------------------------------------------------------------------------------
# Per-format call bodies
# ---------------------------------------------------------------------------------------------

_BAD_NAME = set("{}<>\"' \t\n\r")
_P_OPEN, _P_CLOSE, _F_CLOSE, _T_CLOSE = "<parameter=", "</parameter>", "</function>", "</tool_call>"


def _good_name(name: str) -> bool:
    return bool(name) and not any(c in _BAD_NAME for c in name)


def _next_param(text: str, pos: int, names: set[str] | None = None, lead: bool = True) -> int:
    """Index of the next ``<parameter=`` at a line start from ``pos`` (or -1): at 0, after a
    newline, or (``lead``) after only whitespace from ``pos``. With ``names``, only those
    parameters count."""
    start = pos
    while True:
        i = text.find(_P_OPEN, pos)
        if i < 0:
            return -1
        if i == 0 or text[i - 1] == "\n" or (lead and not text[start:i].strip(_WS)):
            if names is None:
                return i
            e = text.find(">", i + len(_P_OPEN))
            if e >= 0 and text[i + len(_P_OPEN):e] in names:
                return i
        pos = i + 1


def _param_end(value: str) -> int:
    """Index of the ``</parameter>`` that ends ``value``, or -1 (vLLM's structural rule): a
    close counts when what follows (after whitespace) is ``<parameter=``, ``</function>``,
    ``</tool_call>`` or the end; a ``<parameter=`` on a new line before it opens a nested
    (literal) pair whose close it takes."""
    depth, pos = 0, 0
    while True:
        close = value.find(_P_CLOSE, pos)
        if close < 0:
            return -1
        nested = _next_param(value, pos, lead=False)
        if 0 <= nested < close:
            depth, pos = depth + 1, nested + len(_P_OPEN)
            continue
        if depth:
            depth, pos = depth - 1, close + len(_P_CLOSE)
            continue
        after = value[close + len(_P_CLOSE):].lstrip(_WS)
        if not after or after.startswith((_P_OPEN, _F_CLOSE, _T_CLOSE)):
            return close
        pos = close + len(_P_CLOSE)


def _qwen3_call(tools: list[dict]) -> Callable[[str], list[_Event]]:
    def parse(body: str) -> list[_Event]:
        i = body.find("<function=")
        if i < 0 or body[:i].strip(_WS):
            raise _Malformed("no <function=...> in <tool_call>")
        rest = body[i + len("<function="):]
        j = rest.find(">")
        if j < 0:
            raise _Malformed("unterminated <function=")
        name = rest[:j]
        if not _good_name(name):
            raise _Malformed(f"bad function name {name!r}")
        fbody = rest[j + 1:]
        k = fbody.rfind(_F_CLOSE)
        if k >= 0 and not fbody[k + len(_F_CLOSE):].strip(_WS):
            fbody = fbody[:k]
        props = tool_properties(tools, name)
        params: dict = {}
        seen: set[str] = set()
        pos = _next_param(fbody, 0)
        if pos < 0 and fbody.strip(_WS):
            raise _Malformed("text in <function> outside parameters")
        while pos >= 0:
            start = pos + len(_P_OPEN)
            e = fbody.find(">", start)
            if e < 0:
                raise _Malformed("unterminated <parameter=")
            pname = fbody[start:e]
            value = fbody[e + 1:]
            end = _param_end(value)
            if end >= 0:
                text, nxt = value[:end], e + 1 + end + len(_P_CLOSE)
            else:  # missing </parameter>: the next (schema) parameter on a new line, or the body's end
                names = (set(props) - seen - {pname}) if props else None
                n = _next_param(value, 1, names, lead=False)
                text, nxt = (value[:n], e + 1 + n) if n >= 0 else (value, len(fbody))
            seen.add(pname)
            text = text.removeprefix("\n")
            text = text.removesuffix("\n")
            params[pname] = convert_param_value(text, pname, props)
            pos = _next_param(fbody, nxt)
            if pos < 0 and fbody[nxt:].strip(_WS):
                raise _Malformed("text in <function> outside parameters")
        return [_Start(name, _args_json(params)), _End()]

    return parse


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(value: str, string: bool) -> object:
    if string:
        return value
    try:
        return _json_loads(value)
    except ValueError:
        pass
    ok, v = _literal(value)
    return v if ok else value


def _glm_call(tools: list[dict]) -> Callable[[str], list[_Event]]:
    def parse(body: str) -> list[_Event]:
        cut = len(body)
        for m in ("\n", "<arg_key>"):
            k = body.find(m)
            if 0 <= k < cut:
                cut = k
        name = body[:cut].strip(_WS)
        if not _good_name(name):
            raise _Malformed(f"bad function name {name!r}")
        props = tool_properties(tools, name)
        params: dict = {}
        for key, value in _GLM_PAIR.findall(body[cut:]):
            key = key.strip(_WS)
            ptype, _ = _schema_type(props.get(key)) if key in props else ("", False)
            params[key] = _glm_value(value.strip(_WS), ptype == "string")
        return [_Start(name, _args_json(params)), _End()]

    return parse


_KIMI_ID = re.compile(r"[^<]+:\d+")


def _kimi_call(body: str) -> list[_Event]:
    head, sep, args = body.partition("<|tool_call_argument_begin|>")
    call_id = head.strip(_WS)
    if not sep or not _KIMI_ID.fullmatch(call_id):
        raise _Malformed("bad kimi_k2 call header")
    name = call_id.split(":")[0].split(".")[-1]
    if not name:
        raise _Malformed("kimi_k2 call has no name")
    return [_Start(name, _json_args(args), id=call_id), _End()]


def _json_args(text: str) -> str:
    t = text.strip(_WS)
    try:
        value = _loads(t) if t else None
    except ValueError as e:
        raise _Malformed("arguments are not JSON") from e
    return _canonical_args(value)


_DSV3_CALL = re.compile(r"\s*([^\n<]*)<｜tool▁sep｜>([^\n]*)\n```json\n(.*)\n```\s*", re.DOTALL)


def _dsv3_call(body: str) -> list[_Event]:
    m = _DSV3_CALL.fullmatch(body)
    if m is None or not m.group(2).strip():
        raise _Malformed("bad deepseek_v3 call")
    return [_Start(m.group(2).strip(), _json_args(m.group(3))), _End()]


def _dsv31_call(body: str) -> list[_Event]:
    name, sep, args = body.partition("<｜tool▁sep｜>")
    name = name.strip(_WS)
    if not sep or not _good_name(name):
        raise _Malformed("bad deepseek_v31 call")
    return [_Start(name, _json_args(args)), _End()]


class _SeedRegion(_Qwen3Region):
    OPEN, CLOSE = ("<seed:tool_call>",), "</seed:tool_call>"


class _Granite4Region(_HermesRegion):
    KEEP_TEXT = True


class _Phi4Region(_Region):
    """``functools[{...}, ...]``: the array of call objects after the marker; text after it dropped."""

    def __init__(self) -> None:
        self._inner = _GraniteRegion(prefixes=("functools",))

    def feed(self, text: str) -> list[_Event]:
        return self._inner.feed(text)

    def finish(self) -> list[_Event]:
        return self._inner.finish()


class _LongcatRegion(_HermesRegion):
    OPEN, CLOSE = "<longcat_tool_call>", "</longcat_tool_call>"


_INVOKE = re.compile(r"<invoke name=(.*?)</invoke>", re.DOTALL)
_MM_PARAM = re.compile(r"<parameter name=(.*?)</parameter>", re.DOTALL)


def _unquote(text: str) -> str:
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        return t[1:-1]
    return t


def _schema_types(schema: object) -> list[str]:
    """Every type a property schema allows (``type``, ``enum`` values, ``anyOf``/``oneOf``/``allOf``)."""
    if not isinstance(schema, dict):
        return ["string"]
    types: list[str] = []

    def add(t: str) -> None:
        if t not in types:
            types.append(t)

    t = schema.get("type")
    for x in (t if isinstance(t, list) else [t] if isinstance(t, str) else []):
        if isinstance(x, str):
            add(x)
    for v in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        add("null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int) else
            "number" if isinstance(v, float) else "string" if isinstance(v, str) else
            "array" if isinstance(v, list) else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                for x in _schema_types(sub):
                    add(x)
    return types or ["string"]


def minimax_value(value: str, types: list[str]) -> object:
    """A ``minimax_m2`` parameter's text -> JSON value (vLLM ``MinimaxM2ToolParser``'s rules):
    ``null``/``none``/``nil`` -> null; then the first of integer, number, boolean
    (``true/1/yes/on``, ``false/0/no/off``), object/array (JSON), string the schema allows that
    converts; else JSON, else text."""
    if value.lower() in ("null", "none", "nil"):
        return None
    low = [t.lower() for t in types]
    for t in ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str", "text"):
        if t not in low:
            continue
        if t in ("string", "str", "text"):
            return value
        if t in ("integer", "int"):
            try:
                return int(value)
            except ValueError:
                continue
        if t in ("number", "float"):
            try:
                f = float(value)
                return int(f) if f.is_integer() else f
            except (ValueError, OverflowError):
                continue
        if t in ("boolean", "bool"):
            v = value.lower().strip()
            if v in ("true", "1", "yes", "on"):
                return True
            if v in ("false", "0", "no", "off"):
                return False
            continue
        try:
            return _json_loads(value)
        except ValueError:
            continue
    try:
        return _json_loads(value)
    except ValueError:
        return value


def _minimax_calls(tools: list[dict]) -> Callable[[str], list[_Event]]:
    def parse(body: str) -> list[_Event]:
        events: list[_Event] = []
        for inv in _INVOKE.findall(body):
            head, sep, rest = inv.partition(">")
            name = _unquote(head)
            if not sep or not _good_name(name):
                raise _Malformed(f"bad invoke name {head!r}")
            props = tool_properties(tools, name)
            params: dict = {}
            for p in _MM_PARAM.findall(rest):
                pname, psep, value = p.partition(">")
                if not psep:
                    raise _Malformed("bad <parameter name=")
                pname = _unquote(pname)
                value = value.strip()
                params[pname] = minimax_value(value, _schema_types(props[pname]) if pname in props else ["string"])
            events += [_Start(name, _args_json(params)), _End()]
        if not events:
            raise _Malformed("no <invoke> in <minimax:tool_call>")
        return events

    return parse


class _GraniteRegion(_Region):
    """``[<|tool_call|>][<tool_call>][{...}, ...]`` and nothing after it (``trailing``: text after
    the array is dropped instead)."""

    def __init__(self, prefixes: tuple[str, ...] = ("<|tool_call|>", "<tool_call>"), trailing: bool = False) -> None:
        self._prefixes = prefixes
        self._trailing = trailing or prefixes == ("functools",)
        self._buf = ""
        self._state = "prefix"  # prefix | array | done
        self._call: _CallObject | None = None
        self._calls = 0
        self._expect = "first"  # first | obj | sep

    def feed(self, text: str) -> list[_Event]:
        self._buf += text
        events: list[_Event] = []
        while True:
            if self._state == "done":
                if self._buf.strip(_WS) and not self._trailing:
                    raise _Malformed("text after the granite tool-call array")
                self._buf = ""
                return events
            if self._state == "prefix":
                s = self._buf.lstrip(_WS)
                for m in self._prefixes:
                    if s.startswith(m):
                        s = s[len(m):].lstrip(_WS)
                if not s or any(m.startswith(s) for m in self._prefixes):
                    return events
                if s[0] != "[":
                    raise _Malformed("granite tool calls are not a JSON array")
                self._buf, self._state = s[1:], "array"
                continue
            if self._call is not None:
                ev, rest = self._call.feed(self._buf)
                events += ev
                if rest is None:
                    self._buf = ""
                    return events
                self._buf, self._call, self._expect = rest, None, "sep"
                continue
            s = self._buf.lstrip(_WS)
            if not s:
                self._buf = ""
                return events
            if self._expect == "sep":
                if s[0] == "]":
                    self._buf, self._state = s[1:], "done"
                elif s[0] == ",":
                    self._buf, self._expect = s[1:], "obj"
                else:
                    raise _Malformed("bad granite tool-call array")
                continue
            if s[0] == "]" and self._expect == "first":
                raise _Malformed("empty granite tool-call array")
            self._buf, self._call = s, _CallObject()
            self._calls += 1

    def finish(self) -> list[_Event]:
        if self._state != "done" or not self._calls:
            raise _Malformed("unterminated granite tool-call array")
        return []


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


class Qwen3CoderToolParser(ToolParser):
    """``qwen3_coder`` (vLLM ``Qwen3CoderToolParser``): XML-style calls, schema-typed values."""

    name = "qwen3_coder"
    anywhere_markers = ("<tool_call>",)
    close_marker = "</tool_call>"
    marker_texts = ("<tool_call>", "</tool_call>")

    def _region(self) -> _Region:
        return _Qwen3Region(_qwen3_call(self.tools))


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """``qwen3_xml`` (vLLM ``Qwen3XMLToolParser``): the same format as ``qwen3_coder``."""

    name = "qwen3_xml"


class SeedOssToolParser(Qwen3CoderToolParser):
    """``seed_oss`` (vLLM ``SeedOssToolParser``): ``qwen3_coder``'s calls in ``<seed:tool_call>``."""

    name = "seed_oss"
    anywhere_markers = ("<seed:tool_call>",)
    close_marker = "</seed:tool_call>"
    marker_texts = ("<seed:tool_call>", "</seed:tool_call>")

    def _region(self) -> _Region:
        return _SeedRegion(_qwen3_call(self.tools))


class MimoToolParser(Qwen3CoderToolParser):
    """``mimo`` (MiMo): vLLM registers ``qwen3_coder``'s parser under this name too."""

    name = "mimo"


class Granite4ToolParser(HermesToolParser):
    """``granite4`` (vLLM ``Granite4ToolParser``): ``hermes`` calls; text before, between and
    after them is the content."""

    name = "granite4"

    def _region(self) -> _Region:
        return _Granite4Region()


class Phi4MiniJsonToolParser(ToolParser):
    """``phi4_mini_json`` (vLLM ``Phi4MiniJsonToolParser``): ``functools[{"name", "arguments"}, ...]``."""

    name = "phi4_mini_json"
    anywhere_markers = ("functools[",)

    def _region(self) -> _Region:
        return _Phi4Region()


class LongcatToolParser(HermesToolParser):
    """``longcat`` (vLLM ``LongcatFlashToolParser``): ``hermes`` in ``<longcat_tool_call>`` tags."""

    name = "longcat"
    anywhere_markers = ("<longcat_tool_call>",)
    close_marker = "</longcat_tool_call>"
    marker_texts = ("<longcat_tool_call>", "</longcat_tool_call>")

    def _region(self) -> _Region:
        return _LongcatRegion()


class MinimaxM2ToolParser(ToolParser):
    """``minimax_m2`` (vLLM ``MinimaxM2ToolParser``): ``<invoke name=...>`` in ``<minimax:tool_call>``."""

    name = "minimax_m2"
    anywhere_markers = ("<minimax:tool_call>",)
    close_marker = "</minimax:tool_call>"
    marker_texts = ("<minimax:tool_call>", "</minimax:tool_call>")

    def _region(self) -> _Region:
        return _TagRegion(("<minimax:tool_call>",), "</minimax:tool_call>", _minimax_calls(self.tools))


class Glm45ToolParser(ToolParser):
    """``glm45`` (vLLM ``Glm4MoeModelToolParser``): ``<arg_key>``/``<arg_value>`` pairs."""

    name = "glm45"
    anywhere_markers = ("<tool_call>",)
    close_marker = "</tool_call>"
    marker_texts = ("<tool_call>", "</tool_call>")

    def _region(self) -> _Region:
        return _TagRegion(("<tool_call>",), "</tool_call>", _glm_call(self.tools))


class Glm47ToolParser(Glm45ToolParser):
    """``glm47`` (vLLM ``Glm47MoeModelToolParser``): ``glm45`` without the newline after the name."""

    name = "glm47"


class KimiK2ToolParser(ToolParser):
    """``kimi_k2`` (vLLM ``KimiK2ToolParser``): sectioned calls with the model's call ids."""

    name = "kimi_k2"
    anywhere_markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    marker_texts = (*anywhere_markers, "<|tool_calls_section_end|>", "<|tool_call_section_end|>",
                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")

    def _region(self) -> _Region:
        return _TagRegion(("<|tool_call_begin|>",), "<|tool_call_end|>", _kimi_call)


class DeepSeekV3ToolParser(ToolParser):
    """``deepseek_v3`` (vLLM ``DeepSeekV3ToolParser``): fenced JSON after ``<｜tool▁sep｜>NAME``."""

    name = "deepseek_v3"
    anywhere_markers = ("<｜tool▁calls▁begin｜>",)
    marker_texts = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")

    def _region(self) -> _Region:
        return _TagRegion(("<｜tool▁call▁begin｜>",), "<｜tool▁call▁end｜>", _dsv3_call)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """``deepseek_v31`` (vLLM ``DeepSeekV31ToolParser``): ``NAME<｜tool▁sep｜>{...}``."""

    name = "deepseek_v31"

    def _region(self) -> _Region:
        return _TagRegion(("<｜tool▁call▁begin｜>",), "<｜tool▁call▁end｜>", _dsv31_call)


class _HeldRegion(_Region):
    """Another region whose calls are all sent at :meth:`finish` (each whole): for formats where
    text after the calls makes the whole output content, so nothing may be sent before the end."""

    def __init__(self, inner: _Region) -> None:
        self._inner = inner
        self._held: list[_Event] = []

    def feed(self, text: str) -> list[_Event]:
        self._held += self._inner.feed(text)
        return []

    def finish(self) -> list[_Event]:
        events = self._held + self._inner.finish()
        self._held = []
        return _whole(events)


class GraniteToolParser(ToolParser):
    """``granite`` (vLLM ``GraniteToolParser``): the output is a JSON array of calls. Text after
    the array makes all of it content (vLLM's non-streaming ``json.loads`` of the whole), so a
    stream sends the calls at the end."""

    name = "granite"
    start_markers = ("<|tool_call|>", "<tool_call>", "[")
    marker_texts = ("<|tool_call|>", "<tool_call>")

    def _region(self) -> _Region:
        return _HeldRegion(_GraniteRegion())


class Llama4PythonicToolParser(PythonicToolParser):
    """``llama4_pythonic`` (vLLM ``Llama4PythonicToolParser``): ``pythonic`` in ``<|python_start|>``."""

    name = "llama4_pythonic"


class Llama4JsonToolParser(Llama3JsonToolParser):
    """``llama4_json``: vLLM registers ``Llama3JsonToolParser`` under this name too."""

    name = "llama4_json"


# ---------------------------------------------------------------------------------------------
# Harmony (gpt-oss)
# ---------------------------------------------------------------------------------------------

_HARMONY_MARKS = ("<|channel|>", "<|start|>")
_H_CHANNEL, _H_CONSTRAIN, _H_MESSAGE = "<|channel|>", "<|constrain|>", "<|message|>"


class _HarmonyToolStreamer:
    """The ``openai`` parser's streaming state (same interface as
    :class:`kvserve.chat.tool_calls.ToolCallStreamer`)."""

    def __init__(self, parser: HarmonyToolParser) -> None:
        self._parser = parser
        self._mode = "text"  # text | harmony | done
        self._pending = ""
        self._harmony = HarmonyParser()
        self._n = 0
        self.malformed = False

    @property
    def saw_calls(self) -> bool:
        return self._n > 0

    def feed(self, delta_text: str) -> list[dict]:
        if not delta_text or self._mode == "done":
            return []
        if self._mode == "harmony":
            return self._events(self._harmony.feed(delta_text))
        self._pending += delta_text
        best = -1
        for m in _HARMONY_MARKS:
            i = self._pending.find(m)
            if i >= 0 and (best < 0 or i < best):
                best = i
        if best >= 0:
            before, rest = self._pending[:best], self._pending[best:]
            self._pending, self._mode = "", "harmony"
            return self._content(before.rstrip(_WS)) + self._events(self._harmony.feed(rest))
        hold = max(partial_suffix(self._pending, m) for m in _HARMONY_MARKS)
        safe = self._pending[:len(self._pending) - hold]
        emit = safe.rstrip(_WS)
        self._pending = self._pending[len(emit):]
        return self._content(emit)

    def finish(self) -> list[dict]:
        mode, self._mode = self._mode, "done"
        if mode == "text":
            text, self._pending = self._pending, ""
            return self._content(text)
        if mode == "harmony":
            return self._events(self._harmony.finish())
        return []

    @staticmethod
    def _content(text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def _events(self, events) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            msg = ev.message
            if ev.kind in ("plain", "junk"):
                continue  # text outside messages, after harmony began
            assert msg is not None
            is_call = bool(msg.recipient and msg.recipient.startswith("functions."))
            if ev.kind == "text" and not is_call and not msg.recipient and msg.channel in ("final", "commentary"):
                out += self._content(ev.text)
            elif ev.kind == "end" and is_call:
                call = self._call(msg)
                if call is not None:
                    out.append(call)
        return out

    def _call(self, msg) -> dict | None:
        name = msg.recipient[len("functions."):]
        text = msg.content
        args = text
        if not msg.content_type or "json" in msg.content_type:
            try:
                args = _json_args(text)
            except _Malformed:
                if msg.terminator == "":  # cut off (max_tokens): not a complete call
                    logger.warning(_MALFORMED_MSG)
                    self.malformed = True
                    # the text that was there becomes content (as the other parsers give a cut
                    # call's text), in harmony's canonical header form
                    ct = f" {_H_CONSTRAIN}{msg.content_type}" if msg.content_type else ""
                    return {"content": f"{_H_CHANNEL}{msg.channel} to={msg.recipient}{ct}{_H_MESSAGE}{text}"}
                logger.warning("Error decoding JSON tool call from response.")
        if not name:
            return None
        self._n += 1
        return {"tool_calls": [{"index": self._n - 1, "id": self._parser.make_id(), "type": "function",
                                "function": {"name": name, "arguments": args}}]}


class HarmonyToolParser(ToolParser):
    """``openai`` (vLLM ``OpenAIToolParser``): gpt-oss harmony messages with a ``functions.`` recipient."""

    name = "openai"
    rewrites_content = True
    marker_texts = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                    "<|return|>")

    def stream(self, incremental: bool = True) -> _HarmonyToolStreamer:  # type: ignore[override]
        """Streaming state; calls are always sent whole (``incremental`` is ignored)."""
        return _HarmonyToolStreamer(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a finished output: content (preambles + final), calls; no calls -> the content
        the messages give (not the raw text), as vLLM."""
        s = self.stream()
        frags = s.feed(text) + s.finish()
        content = "".join(f["content"] for f in frags if "content" in f)
        calls = [f["tool_calls"][0] for f in frags if "tool_calls" in f]
        if not calls:
            return ExtractedToolCalls(content=content or None, calls=[])
        return ExtractedToolCalls(content=content or None,
                                  calls=[ToolCall(name=c["function"]["name"], arguments=c["function"]["arguments"],
                                                  id=c["id"]) for c in calls])


NEW_TOOL_PARSERS: tuple[type[ToolParser], ...] = (
    Qwen3CoderToolParser, Qwen3XmlToolParser, Glm45ToolParser, Glm47ToolParser, KimiK2ToolParser,
    DeepSeekV3ToolParser, DeepSeekV31ToolParser, GraniteToolParser, Llama4PythonicToolParser,
    Llama4JsonToolParser, HarmonyToolParser, SeedOssToolParser, LongcatToolParser, MinimaxM2ToolParser,
    MimoToolParser, Granite4ToolParser, Phi4MiniJsonToolParser,
)
