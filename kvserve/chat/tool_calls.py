"""Tool-call parsers: turn a model's tool-call text into OpenAI ``tool_calls``.

A model writes a tool call as plain text in its own format; a parser finds that text and
returns OpenAI-shaped calls. Parsers are chosen by vLLM's ``--tool-call-parser`` names:

``hermes``
    Qwen 2.5 / Hermes 2 Pro: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    several in a row. An unterminated last ``<tool_call>`` is parsed too (vLLM's regex does).
``llama3_json``
    Llama 3.x JSON calls: the output (after leading whitespace) is a JSON object
    ``{"name": ..., "parameters"|"arguments": {...}}``, or such objects separated by ``;``,
    optionally after ``<|python_tag|>`` (which may also follow some text).
``mistral``
    ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects, or the
    newer ``[TOOL_CALLS]name[ARGS]{...}`` form (repeated per call, ``[CALL_ID]id`` allowed
    before ``[ARGS]``). Ids are 9 alphanumerics, as Mistral templates require.
``pythonic``
    The whole output is a Python list of calls, ``[read_file(path="a"), list_dir(path="src")]``
    (optionally inside ``<|python_start|>``/``<|python_end|>``); keyword arguments with literal
    values only (``ast.literal_eval``), as vLLM's ``pythonic`` parser.

More formats (``qwen3_coder``, ``glm45``, ``kimi_k2``, ``deepseek_v3``, ``granite``, ``openai``
(gpt-oss harmony), ...) live in :mod:`kvserve.chat.tool_formats`; all are registered by name in
:mod:`kvserve.chat.tool_parsers` (``TOOL_PARSERS``, ``get_tool_parser``), with ``VLLM_TOOL_PARSERS``,
every name vLLM registers, and ``tool_parser_error``, the start-up error for one kvserve lacks. Parsers take the request's ``tools`` (the XML formats
convert values by their schema types).

Results (all parsers):

* ``content`` is the text before the first call marker with trailing whitespace stripped
  (vLLM keeps the trailing newline; seed 002 Example 11 shows it trimmed), or ``None`` when
  that is empty. Text between and after calls is dropped (vLLM does the same).
* ``arguments`` is JSON text re-serialized the way ``json.dumps(obj, ensure_ascii=False)``
  writes it (``", "`` and ``": "`` separators, vLLM's form); missing, ``null`` or empty
  arguments give ``"{}"``. Duplicate keys are kept in order (the model's text, not a dict).
* Malformed call text (bad JSON, missing name, arguments that are not an object) makes the
  whole output plain content with no calls, and logs
  ``"Error in extracting tool call from response."`` (vLLM's message and behaviour).

Streaming (:meth:`ToolParser.stream`) feeds decoded text deltas and returns OpenAI delta
fragments. Text that cannot start a call streams as content at once; a possible marker prefix
and trailing whitespace are held back. For the JSON formats the argument text is streamed as
it is generated (one fragment per JSON token, and string values piece by piece), re-serialized
the same way as the non-streaming result, so the concatenated fragments of call ``k`` equal
``extract(...).calls[k].arguments`` exactly (both go through the same incremental code).
Limits: what was streamed cannot be taken back, so output that turns malformed after a call
(or, incrementally, a call's name) was sent differs from ``extract``, which then returns
everything as content; the stream keeps what it sent and drops the rest (vLLM and
llama-server stream partial arguments the same way). ``stream(incremental=False)`` sends each
call whole once it closed and parsed, so a malformed first call still streams as content.
``pythonic`` calls are always sent when the list closes.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.detokenizer import partial_suffix

__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "detect_tool_parser",
    "make_call_id",
]

logger = logging.getLogger(__name__)

_MALFORMED_MSG = "Error in extracting tool call from response."
_ALNUM = string.ascii_letters + string.digits


def make_call_id(length: int = 24, prefix: str = "call_") -> str:
    """A random tool-call id: ``prefix`` + ``length`` random letters/digits (cryptographic RNG)."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. ``arguments`` is JSON text (an object), never a dict."""

    name: str
    arguments: str
    id: str

    def to_openai(self) -> dict:
        """The OpenAI ``message.tool_calls[i]`` object."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    """Result of :meth:`ToolParser.extract`: ``content`` (``None`` when empty) and the calls."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class _Malformed(ValueError):
    """Internal: the call text cannot be parsed."""


# ---------------------------------------------------------------------------------------------
# JSON helpers shared by the streaming and the non-streaming path
# ---------------------------------------------------------------------------------------------


class _Obj(list):
    """A JSON object parsed as its ordered (key, value) pairs (duplicates kept)."""


def _loads(text: str) -> object:
    """``json.loads`` with objects as :class:`_Obj`; raises ValueError on anything it rejects,
    also on nesting deeper than the interpreter's stack (RecursionError there) and on integers
    over Python's 4300-digit conversion limit (a ValueError already)."""
    try:
        return json.loads(text, object_pairs_hook=_Obj)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def _json_loads(text: str) -> object:
    """Plain ``json.loads``; raises ValueError on anything it rejects, also on nesting deeper than
    the interpreter's stack (a RecursionError there)."""
    try:
        return json.loads(text)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def _dump(value: object) -> str:
    """Serialize a :func:`_loads` value exactly as ``json.dumps(v, ensure_ascii=False)`` would;
    raises _Malformed when it is nested deeper than the interpreter's stack allows."""
    try:
        return _dump_value(value)
    except RecursionError as e:
        raise _Malformed("JSON nested too deeply") from e


def _dump_value(value: object) -> str:
    if isinstance(value, _Obj):
        return "{" + ", ".join(json.dumps(k, ensure_ascii=False) + ": " + _dump_value(v) for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dump_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _first(pairs: _Obj, keys: tuple[str, ...]) -> tuple[bool, object]:
    for k, v in pairs:
        if k in keys:
            return True, v
    return False, None


def _call_from_obj(obj: object) -> tuple[str, str]:
    """(name, canonical arguments) of a parsed call object; raises _Malformed."""
    if not isinstance(obj, _Obj):
        raise _Malformed("call is not a JSON object")
    found, name = _first(obj, ("name",))
    if not found or not isinstance(name, str) or not name:
        raise _Malformed("call has no name")
    _, args = _first(obj, ("arguments", "parameters"))
    return name, _canonical_args(args)


def _canonical_args(args: object) -> str:
    if args is None or args == "":
        return "{}"
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = _loads(args)
        except ValueError as e:
            raise _Malformed("arguments string is not JSON") from e
    if not isinstance(args, _Obj):
        raise _Malformed("arguments are not an object")
    return _dump(args)


class _JsonCanon:
    """Incremental canonical re-serialization of one JSON object or array.

    ``feed(chars)`` returns the canonical text (``json.dumps(..., ensure_ascii=False)`` form)
    of what those chars complete: one piece per token, string contents as they arrive. It
    stops at the end of the value (``done``; later chars are ignored) and raises _Malformed
    on anything ``json.loads`` would reject. Only containers at the top level.
    """

    __slots__ = ("_esc", "_stack", "_tok", "consumed", "done")

    def __init__(self) -> None:
        self.done = False
        self.consumed = 0  # chars of the last feed() used (less than all once done)
        # frames: [kind "{" or "[", expect]; expect in key|key_or_close|colon|value|value_or_close|comma_or_close
        self._stack: list[list[str]] = []
        self._tok: str | None = None  # None | "str" | atom chars (non-empty str)
        self._esc = ""  # pending escape text inside a string (starts with a backslash)

    def feed(self, chars: str) -> str:
        out: list[str] = []
        i, n = 0, len(chars)
        while i < n and not self.done:
            c = chars[i]
            if self._tok == "str":
                i = self._string(chars, i, out)
                continue
            if self._tok is not None:  # atom in progress
                if c.isalnum() or c in "+-.":
                    self._tok += c
                    i += 1
                    continue
                self._end_atom(out)
                continue  # reprocess c
            i += 1
            if c in " \t\n\r":
                continue
            if not self._stack:
                if c in "{[":
                    self._stack.append([c, "key_or_close" if c == "{" else "value_or_close"])
                    out.append(c)
                    continue
                raise _Malformed("arguments are not a JSON object")
            frame = self._stack[-1]
            exp = frame[1]
            if exp in ("key", "key_or_close"):
                if c == '"':
                    self._tok = "str"
                    frame[1] = "colon"
                    out.append('"')
                elif c == "}" and exp == "key_or_close":
                    self._close(out, "}")
                else:
                    raise _Malformed("bad object key")
            elif exp == "colon":
                if c != ":":
                    raise _Malformed("expected ':'")
                frame[1] = "value"
                out.append(": ")
            elif exp in ("value", "value_or_close"):
                if c == "]" and exp == "value_or_close":
                    self._close(out, "]")
                    continue
                frame[1] = "comma_or_close"
                if c == '"':
                    self._tok = "str"
                    out.append('"')
                elif c in "{[":
                    self._stack.append([c, "key_or_close" if c == "{" else "value_or_close"])
                    out.append(c)
                elif c.isalnum() or c == "-":
                    self._tok = c
                else:
                    raise _Malformed("bad value")
            else:  # comma_or_close
                if c == ",":
                    frame[1] = "key" if frame[0] == "{" else "value"
                    out.append(", ")
                elif c == ("}" if frame[0] == "{" else "]"):
                    self._close(out, c)
                else:
                    raise _Malformed("expected ',' or a closing bracket")
        self.consumed = i
        return "".join(out)

    def _close(self, out: list[str], c: str) -> None:
        self._stack.pop()
        out.append(c)
        if not self._stack:
            self.done = True

    def _end_atom(self, out: list[str]) -> None:
        tok, self._tok = self._tok, None
        try:
            v = json.loads(tok)  # numbers, true/false/null, NaN/Infinity like json.loads
        except ValueError as e:
            raise _Malformed(f"bad JSON literal {tok!r}") from e
        if isinstance(v, (str, list, dict)):
            raise _Malformed("bad JSON literal")
        out.append(json.dumps(v))

    def _string(self, chars: str, i: int, out: list[str]) -> int:
        """Consume string content from chars[i:]; return the next index."""
        n = len(chars)
        while i < n:
            c = chars[i]
            if self._esc:
                self._esc += c
                i += 1
                while self._esc:
                    got = self._resolve()
                    if got is None:
                        break
                    text, reprocess = got
                    out.append(json.dumps(text, ensure_ascii=False)[1:-1])
                    if reprocess:  # the char after a lone high surrogate is plain content
                        i -= 1
                continue
            if c == "\\":
                self._esc = c
                i += 1
                continue
            if c == '"':
                out.append('"')
                self._tok = None
                return i + 1
            if c < " ":
                raise _Malformed("control character in a JSON string")
            # a run of plain characters is its own canonical form
            j = i + 1
            while j < n and chars[j] not in '"\\' and chars[j] >= " ":
                j += 1
            out.append(chars[i:j])
            i = j
        return i

    def _resolve(self) -> tuple[str, bool] | None:
        """Decode the pending escape once complete: (text, reprocess the last char) or None.

        Decodes like ``json.loads``: a high surrogate escape followed by a low one is one
        character; otherwise each surrogate stays a lone code point.
        """
        e = self._esc
        if len(e) < 2:
            return None
        if e[1] != "u":
            if e[1] not in '"\\/bfnrt':
                raise _Malformed("bad escape")
            self._esc = ""
            return json.loads(f'"{e}"'), False
        if len(e) < 6:
            return None
        hi = _hex4(e[2:6])
        if not 0xD800 <= hi <= 0xDBFF:
            self._esc = ""
            return chr(hi), False
        if len(e) == 6:
            return None
        if e[6] != "\\":
            self._esc = ""
            return chr(hi), True
        if len(e) == 7:
            return None
        if e[7] != "u":
            self._esc = e[6:]
            return chr(hi), False
        if len(e) < 12:
            return None
        lo = _hex4(e[8:12])
        if 0xDC00 <= lo <= 0xDFFF:
            self._esc = ""
            return chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)), False
        self._esc = e[6:]
        return chr(hi), False


def _hex4(h: str) -> int:
    if not all(c in string.hexdigits for c in h):
        raise _Malformed("bad \\u escape")
    return int(h, 16)


class _JsonSkipper:
    """Finds where a top-level JSON object ends (strings and nesting aware, no validation)."""

    __slots__ = ("_depth", "_esc", "_in_str", "started")

    def __init__(self) -> None:
        self._depth = 0
        self._in_str = False
        self._esc = False
        self.started = False

    def feed(self, text: str) -> int:
        """Index just past the closing brace in ``text``, or -1 when the object is still open."""
        for i, c in enumerate(text):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                continue
            if not self.started:
                if c in " \t\n\r":
                    continue
                if c != "{":
                    raise _Malformed("call is not a JSON object")
                self.started = True
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1


# ---------------------------------------------------------------------------------------------
# Events and the streaming JSON call object
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Start:
    name: str
    args: str
    id: str | None = None  # the model's own call id (kimi_k2), else a fresh one is made


@dataclass(slots=True)
class _Args:
    args: str


@dataclass(slots=True)
class _End:
    """The current call is complete and checked."""


@dataclass(slots=True)
class _Text:
    """Content text from inside the call region (formats that keep text between calls)."""

    text: str


_Event = _Start | _Args | _End | _Text


def _scan_string(text: str, i: int) -> tuple[str, int] | None:
    """A complete JSON string starting at text[i] (a quote): (decoded, end index) or None."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            try:
                return json.loads(text[i:j + 1]), j + 1
            except ValueError as e:
                raise _Malformed("bad JSON string") from e
        j += 1
    return None


_MORE = object()


def _scan_header(text: str) -> object:
    """Match ``{"name": "<n>", "arguments"|"parameters": `` at the start of text.

    Returns (name, offset after the colon), None when the text cannot start that way, or
    _MORE when more text is needed.
    """
    i = 0

    def ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\n\r":
            i += 1
        return i

    steps = ("{", "key:name", ":", "name", ",", "key:args", ":")
    name = ""
    for step in steps:
        i = ws(i)
        if i >= len(text):
            return _MORE
        if step in "{:,":
            if text[i] != step:
                return None
            i += 1
            continue
        if text[i] != '"':
            return None
        got = _scan_string(text, i)
        if got is None:
            return _MORE
        s, i = got
        if step == "key:name" and s != "name":
            return None
        if step == "key:args" and s not in ("arguments", "parameters"):
            return None
        if step == "name":
            if not s:
                return None  # no name: the whole-object path reports it malformed
            name = s
    return name, i


class _CallObject:
    """One JSON call object ``{"name": ..., "arguments": {...}}`` fed piece by piece.

    When the object starts with its name and then its arguments object, the arguments are
    streamed through :class:`_JsonCanon`; otherwise the call is sent whole when it closes.
    Either way the closed object is parsed with ``json.loads`` and checked (:func:`_call_from_obj`).
    """

    def __init__(self) -> None:
        self._skip = _JsonSkipper()
        self._raw: list[str] = []
        self._head = ""
        self._state = "head"  # head | preval | val | tail | whole
        self._name = ""
        self._canon = _JsonCanon()
        self._emitted: list[str] = []
        self.closed = False

    def feed(self, text: str) -> tuple[list[_Event], str | None]:
        """Events for ``text`` and, once the object closed, the text after it (else None)."""
        end = self._skip.feed(text)
        part = text if end < 0 else text[:end]
        self._raw.append(part)
        events = self._advance(part)
        if end < 0:
            return events, None
        self.closed = True
        return events + self._finish(), text[end:]

    def _advance(self, part: str) -> list[_Event]:
        if self._state == "head":
            self._head += part
            got = _scan_header(self._head)
            if got is _MORE:
                return []
            if not isinstance(got, tuple):
                self._state = "whole"
                return []
            self._name, off = got
            part, self._head = self._head[off:], ""
            self._state = "preval"
        if self._state == "preval":
            rest = part.lstrip(" \t\n\r")
            if not rest:
                return []
            if rest[0] != "{":
                self._state = "whole"
                return []
            self._state = "val"
            out = self._canon.feed(rest)
            self._emitted.append(out)
            self._maybe_done()
            return [_Start(self._name, out)]
        if self._state == "val":
            out = self._canon.feed(part)
            self._emitted.append(out)
            self._maybe_done()
            return [_Args(out)] if out else []
        return []

    def _maybe_done(self) -> None:
        if self._canon.done:
            self._state = "tail"

    def _finish(self) -> list[_Event]:
        try:
            obj = _loads("".join(self._raw))
        except ValueError as e:
            raise _Malformed("bad JSON in tool call") from e
        name, args = _call_from_obj(obj)
        if self._state in ("val", "tail"):
            if name != self._name or args != "".join(self._emitted):
                raise _Malformed("streamed call differs from the parsed one")
            return [_End()]
        return [_Start(name, args), _End()]


# ---------------------------------------------------------------------------------------------
# Per-format regions (everything from the first call marker on)
# ---------------------------------------------------------------------------------------------


class _Region:
    """Stateful scanner of the call region; raises _Malformed."""

    def feed(self, text: str) -> list[_Event]:
        raise NotImplementedError

    def finish(self) -> list[_Event]:
        raise NotImplementedError


def _whole(events: list[_Event]) -> list[_Event]:
    """``events`` with each call's ``_Start`` and ``_Args`` merged into one ``_Start`` (a call
    held back and sent whole)."""
    out: list[_Event] = []
    for ev in events:
        if isinstance(ev, _Args):
            start = out[-1]
            assert isinstance(start, _Start)
            out[-1] = _Start(start.name, start.args + ev.args, start.id)
        else:
            out.append(ev)
    return out


class _HermesRegion(_Region):
    """``<tool_call>`` JSON ``</tool_call>`` blocks. A call is sent whole once its close marker
    came and its JSON parsed (the events are held until then): a ``</tool_call>`` inside a
    JSON string, or a value JSON rejects, makes the call malformed in a stream exactly as in
    the finished text (vLLM's non-streaming regex + ``json.loads``), never half-sent arguments."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    #: keep text between and after calls as content (granite4), else it is dropped (hermes)
    KEEP_TEXT = False

    def __init__(self) -> None:
        self._buf = ""
        self._call: _CallObject | None = None
        self._held: list[_Event] = []  # the open call's events, sent at its close
        self._after = ""  # text after the object, before </tool_call>
        self._outside = ""  # KEEP_TEXT: text since the last call, sent when the next starts or at the end

    def _text_events(self, text: str, final: bool) -> list[_Event]:
        if not self.KEEP_TEXT:
            return []
        self._outside += text
        if not final and not self._outside.strip():
            return []
        out, self._outside = self._outside, ""
        return [_Text(out)] if out.strip() else []

    def feed(self, text: str) -> list[_Event]:
        self._buf += text
        events: list[_Event] = []
        while True:
            if self._call is None:
                i = self._buf.find(self.OPEN)
                if i < 0:  # text between calls is dropped; keep a possible marker prefix
                    k = partial_suffix(self._buf, self.OPEN)
                    if self.KEEP_TEXT:
                        self._outside += self._buf[:len(self._buf) - k]
                    self._buf = self._buf[len(self._buf) - k:] if k else ""
                    return events
                events += self._text_events(self._buf[:i], final=True)
                self._buf = self._buf[i + len(self.OPEN):]
                self._call, self._after = _CallObject(), ""
                continue
            j = self._buf.find(self.CLOSE)
            safe = self._buf[:j] if j >= 0 else self._buf[:len(self._buf) - partial_suffix(self._buf, self.CLOSE)]
            events += self._forward(safe)
            if j < 0:
                self._buf = self._buf[len(safe):]
                return events
            self._buf = self._buf[j + len(self.CLOSE):]
            events += self._end_call()

    def _forward(self, text: str) -> list[_Event]:
        assert self._call is not None
        if self._call.closed:
            self._after += text
            return []
        events, rest = self._call.feed(text)
        if rest is not None:
            self._after += rest
        # the call is complete only at </tool_call>, once the text after the object is checked
        self._held += [ev for ev in events if not isinstance(ev, _End)]
        return []

    def _end_call(self) -> list[_Event]:
        assert self._call is not None
        if not self._call.closed or self._after.strip():
            raise _Malformed("bad text inside <tool_call>")
        self._call = None
        held, self._held = self._held, []
        return _whole(held + [_End()])

    def finish(self) -> list[_Event]:
        if self._call is None:
            text, self._buf = self._buf, ""
            return self._text_events(text, final=True)
        events = self._forward(self._buf)  # unterminated last call: parse what is there
        self._buf = ""
        return events + self._end_call()


class _Llama3Region(_Region):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._state = "tag"  # tag | next | obj | sep
        self._call: _CallObject | None = None
        self._calls = 0

    def feed(self, text: str) -> list[_Event]:
        self._buf += text
        events: list[_Event] = []
        while self._buf:
            if self._state == "tag":
                s = self._buf.lstrip(" \t\n\r")
                if self.TAG.startswith(s):
                    return events
                if s.startswith(self.TAG):
                    self._buf = s[len(self.TAG):]
                self._state = "next"
            elif self._state == "next":
                s = self._buf.lstrip(" \t\n\r")
                if not s:
                    self._buf = ""
                    return events
                self._buf, self._call, self._state = s, _CallObject(), "obj"
                self._calls += 1
            elif self._state == "obj":
                assert self._call is not None
                ev, rest = self._call.feed(self._buf)
                events += ev
                self._buf = rest or ""
                if rest is not None:
                    self._state = "sep"
            else:  # sep: only ";" may follow a call (vLLM splits on "; ")
                s = self._buf.lstrip(" \t\n\r")
                if not s:
                    self._buf = ""
                    return events
                if s[0] != ";":
                    raise _Malformed("text after a llama3 JSON call")
                self._buf, self._state = s[1:], "next"
        return events

    def finish(self) -> list[_Event]:
        if self._state in ("tag", "obj") or not self._calls:
            raise _Malformed("unterminated llama3 JSON call")
        return []


_MISTRAL_NAME = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?")


class _MistralRegion(_Region):
    MARK = "[TOOL_CALLS]"
    _MID_CALL = ("arr_obj", "name", "args_start", "args")

    def __init__(self) -> None:
        self._buf = ""
        self._state = "seek"  # seek | kind | arr_next | arr_obj | arr_sep | name | args_start | args
        self._call: _CallObject | None = None
        self._canon = _JsonCanon()
        self._name = ""
        self._calls = 0

    def feed(self, text: str) -> list[_Event]:
        self._buf += text
        events: list[_Event] = []
        while self._buf:
            st = self._state
            if st == "seek":  # text outside calls is dropped
                i = self._buf.find(self.MARK)
                if i < 0:
                    k = partial_suffix(self._buf, self.MARK)
                    self._buf = self._buf[len(self._buf) - k:] if k else ""
                    return events
                self._buf, self._state = self._buf[i + len(self.MARK):], "kind"
                continue
            if st == "args":
                out = self._canon.feed(self._buf)
                if out:
                    events.append(_Args(out))
                events += self._after_args()
                continue
            if st in ("arr_obj",):
                assert self._call is not None
                ev, rest = self._call.feed(self._buf)
                events += ev
                self._buf = rest or ""
                if rest is not None:
                    self._state = "arr_sep"
                continue
            if st == "name":
                i = self._buf.find("[ARGS]")
                if i < 0:
                    if len(self._buf) > 256 or any(c in self._buf for c in " \t\n\r{}\"'"):
                        raise _Malformed("bad [TOOL_CALLS] function name")
                    return events
                m = _MISTRAL_NAME.fullmatch(self._buf[:i])
                if m is None:
                    raise _Malformed("bad [TOOL_CALLS] function name")
                self._name, self._buf, self._state = m.group(1), self._buf[i + len("[ARGS]"):], "args_start"
                continue
            s = self._buf.lstrip(" \t\n\r")
            if not s:
                self._buf = ""
                return events
            if st == "kind":
                if s[0] == "[":
                    self._buf, self._state = s[1:], "arr_next"
                else:
                    self._buf, self._state = s, "name"
            elif st == "arr_next":
                self._buf, self._call, self._state = s, _CallObject(), "arr_obj"
                self._calls += 1
            elif st == "arr_sep":
                if s[0] not in ",]":
                    raise _Malformed("bad [TOOL_CALLS] array")
                self._buf, self._state = s[1:], ("arr_next" if s[0] == "," else "seek")
            else:  # args_start
                if s[0] != "{":
                    raise _Malformed("[ARGS] is not a JSON object")
                self._canon = _JsonCanon()
                events.append(_Start(self._name, self._canon.feed(s)))
                self._calls += 1
                self._buf = s
                events += self._after_args()
        return events

    def _after_args(self) -> list[_Event]:
        if self._canon.done:
            self._buf, self._state = self._buf[self._canon.consumed:], "seek"
            return [_End()]
        self._buf, self._state = "", "args"
        return []

    def finish(self) -> list[_Event]:
        if self._state in self._MID_CALL or not self._calls:
            raise _Malformed("unterminated [TOOL_CALLS] call")
        return []


class _PythonicRegion(_Region):
    """The output as one Python list of calls, parsed at the end: text after the list makes all
    of it content (vLLM's non-streaming ``ast.parse`` of the whole output), so the calls are
    sent at :meth:`finish`, never before the stream knows nothing follows them."""

    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> list[_Event]:
        buf, self._buf = self._buf, ""
        buf += text  # grows in place: linear however many deltas come
        self._buf = buf
        return []

    def _body(self) -> str:
        s = self._buf.strip()
        if s.startswith(self.START):
            s = s[len(self.START):]
            if s.rstrip().endswith(self.END):
                s = s.rstrip()[: -len(self.END)]
        return s.strip()

    def finish(self) -> list[_Event]:
        if self._done:
            return []
        self._done = True
        return _whole_calls(_parse_pythonic(self._body()))


def _whole_calls(calls: list[tuple[str, str]]) -> list[_Event]:
    return [ev for n, a in calls for ev in (_Start(n, a), _End())]


def _parse_pythonic(text: str) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _Malformed("not a Python list of calls") from e
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise _Malformed("not a Python list of calls")
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise _Malformed("pythonic call must be name(keyword=literal, ...)")
        args = _Obj()
        for kw in node.keywords:
            if kw.arg is None:
                raise _Malformed("**kwargs in a pythonic call")
            try:
                value = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
                raise _Malformed("pythonic argument is not a literal") from e
            args.append((kw.arg, _jsonable(value)))
        calls.append((node.func.id, _dump(args)))
    return calls


def _jsonable(v: object) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise _Malformed("dict keys must be strings")
        return _Obj((k, _jsonable(x)) for k, x in v.items())
    raise _Malformed(f"{type(v).__name__} is not a JSON value")


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


class ToolParser:
    """Base class. Subclasses set ``name`` and the marker rules and build a region scanner.

    Args:
        make_id: returns a fresh call id (default: ``call_`` + 24 random alphanumerics;
            Mistral: 9 alphanumerics). Tests pass a counter for fixed ids.
    """

    name: str = ""
    #: markers that start the call region anywhere in the text
    anywhere_markers: tuple[str, ...] = ()
    #: markers that start it only when all text before is whitespace
    start_markers: tuple[str, ...] = ()
    #: text that closes one call (hermes); lets :meth:`extract` tell a cut-off last call
    close_marker: str = ""
    #: marker texts that are added/control tokens in the model family's vocabulary: the
    #: detokenizer must render them for this parser to see the calls (the chat face preserves
    #: these, ``anywhere_markers``, ``start_markers`` and ``close_marker`` when each is one
    #: control token of the loaded vocabulary; llama-server's ``preserved_tokens``)
    marker_texts: tuple[str, ...] = ()
    #: :meth:`extract`'s content is not the raw text even without calls (harmony messages)
    rewrites_content: bool = False

    def __init__(self, make_id: Callable[[], str] | None = None, tools: list[dict] | None = None) -> None:
        self.make_id = make_id or make_call_id
        self.tools = tools or []

    def _region(self) -> _Region:
        raise NotImplementedError

    def stream(self, incremental: bool = True) -> ToolCallStreamer:
        """A fresh streaming state for one response (see :class:`ToolCallStreamer`)."""
        return ToolCallStreamer(self, incremental)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a finished output. Malformed calls: all of ``text`` as content, no calls."""
        s = self.stream()
        frags = s.feed(text) + s.finish()
        if s.malformed and self.close_marker and self.anywhere_markers:
            # An output cut off (max_tokens) inside its last call, which has no closing marker:
            # keep the whole calls before it when they parse (the unfinished one is dropped and
            # logged). A call that was closed but is broken still makes all of it content (vLLM).
            cut = max(text.rfind(m) for m in self.anywhere_markers)
            if cut > 0 and self.close_marker not in text[cut:]:
                head = self.extract(text[:cut].rstrip())
                if head.calls:
                    logger.warning("dropped a malformed or unfinished last tool call")
                    return head
        if s.malformed or not s.saw_calls:
            return ExtractedToolCalls(content=text, calls=[])
        content: list[str] = []
        calls: list[list[str]] = []  # [id, name, args]
        for f in frags:
            if "content" in f:
                content.append(f["content"])
                continue
            tc = f["tool_calls"][0]
            if "id" in tc:
                calls.append([tc["id"], tc["function"]["name"], tc["function"]["arguments"]])
            else:
                calls[tc["index"]][2] += tc["function"]["arguments"]
        return ExtractedToolCalls(content="".join(content) or None,
                                  calls=[ToolCall(name=n, arguments=a, id=i) for i, n, a in calls])

    def find_start(self, text: str, at_start: bool) -> tuple[int, int]:
        """(index of the first call marker or -1, index from which text must be held back).

        ``at_start`` says no non-whitespace content came before ``text``.
        """
        best = -1
        for m in self.anywhere_markers:
            i = text.find(m)
            if i >= 0 and (best < 0 or i < best):
                best = i
        hold = len(text) - max((partial_suffix(text, m) for m in self.anywhere_markers), default=0)
        if at_start and self.start_markers:
            s = text.lstrip(" \t\n\r")
            lead = len(text) - len(s)
            if not s:
                return best, 0
            for m in self.start_markers:
                if s.startswith(m):
                    return lead, lead
                if m.startswith(s):
                    hold = min(hold, lead)
        return best, (best if best >= 0 else hold)


class HermesToolParser(ToolParser):
    """``hermes`` (vLLM ``Hermes2ProToolParser``): ``<tool_call>`` JSON ``</tool_call>`` blocks."""

    name = "hermes"
    anywhere_markers = ("<tool_call>",)
    close_marker = "</tool_call>"
    marker_texts = ("<tool_call>", "</tool_call>")

    def _region(self) -> _Region:
        return _HermesRegion()


class Llama3JsonToolParser(ToolParser):
    """``llama3_json`` (vLLM ``Llama3JsonToolParser``): JSON objects separated by ``;``."""

    name = "llama3_json"
    anywhere_markers = ("<|python_tag|>",)
    start_markers = ("{",)
    marker_texts = ("<|python_tag|>",)

    def _region(self) -> _Region:
        return _Llama3Region()


class MistralToolParser(ToolParser):
    """``mistral`` (vLLM ``MistralToolParser``): ``[TOOL_CALLS]`` + JSON array or ``name[ARGS]{...}``."""

    name = "mistral"
    anywhere_markers = ("[TOOL_CALLS]",)
    marker_texts = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def __init__(self, make_id: Callable[[], str] | None = None, tools: list[dict] | None = None) -> None:
        super().__init__(make_id or (lambda: make_call_id(9, "")), tools)

    def _region(self) -> _Region:
        return _MistralRegion()


class PythonicToolParser(ToolParser):
    """``pythonic`` (vLLM ``PythonicToolParser``): the output is ``[f(a=1), g(b="x")]``."""

    name = "pythonic"
    start_markers = ("[", "<|python_start|>")
    marker_texts = ("<|python_start|>", "<|python_end|>")

    def _region(self) -> _Region:
        return _PythonicRegion()


class ToolCallStreamer:
    """Streaming state for one response; create with :meth:`ToolParser.stream`.

    ``feed(delta_text)`` and ``finish()`` return OpenAI delta fragments, each either
    ``{"content": str}`` or ``{"tool_calls": [{"index": k, ...}]}``: the first fragment of
    call ``k`` carries ``id``, ``type`` and ``function.name`` plus the first arguments text
    (possibly ``""``); later ones carry only ``index`` and ``function.arguments``. Calls are
    numbered 0, 1, 2... With ``incremental=False`` each call comes as one fragment once it
    closed and parsed. Not thread-safe (one response, one task).

    Attributes:
        saw_calls: at least one call was sent (finish_reason ``"tool_calls"``).
        malformed: a call failed to parse (logged; after the first call was sent the rest is
            dropped, before it everything turns into content).
    """

    def __init__(self, parser: ToolParser, incremental: bool = True) -> None:
        self._parser = parser
        self._incremental = incremental
        self._held: list[str] | None = None  # not incremental: [name, args] of the open call
        self._mode = "text"  # text | region | passthrough | done
        self._pending = ""  # text mode: held back (possible marker prefix, trailing whitespace)
        self._at_start = True
        self._region: _Region | None = None
        self._region_text: list[str] = []
        self._held_ws = ""
        self._n = 0
        self.malformed = False

    @property
    def saw_calls(self) -> bool:
        return self._n > 0

    def feed(self, delta_text: str) -> list[dict]:
        if not delta_text:
            return []
        if self._mode == "passthrough":
            return [{"content": delta_text}]
        if self._mode == "done":
            return []
        if self._mode == "region":
            return self._region_feed(delta_text)
        self._pending += delta_text
        pos, hold = self._parser.find_start(self._pending, self._at_start)
        if pos >= 0:
            before = self._pending[:pos]
            out = self._content(before.rstrip())
            self._held_ws = before[len(before.rstrip()):]
            rest, self._pending = self._pending[pos:], ""
            self._mode, self._region = "region", self._parser._region()
            return out + self._region_feed(rest)
        safe = self._pending[:hold]
        emit = safe.rstrip()
        self._pending = self._pending[len(emit):]
        return self._content(emit)

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        self._at_start = False
        return [{"content": text}]

    def _region_feed(self, text: str) -> list[dict]:
        assert self._region is not None
        self._region_text.append(text)
        try:
            return self._fragments(self._region.feed(text))
        except (_Malformed, RecursionError):  # RecursionError: a value nested past the stack
            return self._fail()

    def _fail(self) -> list[dict]:
        logger.warning(_MALFORMED_MSG)
        self.malformed = True
        if self._n:
            self._mode = "done"
            return []
        self._mode = "passthrough"
        return self._content(self._held_ws + "".join(self._region_text))

    def _call_fragments(self, events: list[_Event]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if not self._incremental:
                if isinstance(ev, _Start):
                    self._held = [ev.name, ev.args, ev.id]
                elif isinstance(ev, _Args):
                    assert self._held is not None
                    self._held[1] += ev.args
                else:
                    assert self._held is not None
                    out.append(self._first(*self._held))
                    self._held = None
            elif isinstance(ev, _Start):
                out.append(self._first(ev.name, ev.args, ev.id))
            elif isinstance(ev, _Args) and ev.args:
                out.append({"tool_calls": [{"index": self._n - 1, "function": {"arguments": ev.args}}]})
        return out

    def _fragments(self, events: list[_Event]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, _Text):
                out += self._content(ev.text)
            else:
                out += self._call_fragments([ev])
        return out

    def _first(self, name: str, args: str, call_id: str | None = None) -> dict:
        self._n += 1
        return {"tool_calls": [{"index": self._n - 1, "id": call_id or self._parser.make_id(), "type": "function",
                                "function": {"name": name, "arguments": args}}]}

    def finish(self) -> list[dict]:
        """Flush at the end of generation (unterminated calls are parsed or become content)."""
        mode, self._mode = self._mode, "done"
        if mode == "text":
            text, self._pending = self._pending, ""
            return self._content(text)
        if mode != "region":
            return []
        assert self._region is not None
        try:
            return self._fragments(self._region.finish())
        except (_Malformed, RecursionError):
            self._mode = "region"
            out = self._fail()
            self._mode = "done"
            return out


def detect_tool_parser(template_source: str) -> str | None:
    """Pick a parser from a chat template's source text (llama-server-like detection).

    harmony (``<|channel|>`` and ``<|message|>``) -> openai; ``<|tool_calls_section_begin|>`` ->
    kimi_k2; ``<｜tool▁calls▁begin｜>`` -> deepseek_v3 (deepseek_v31 when the template has no
    fenced JSON); ``<arg_key>`` -> glm45; ``<function=`` and ``<parameter=`` -> qwen3_coder;
    ``<|tool_call|>`` -> granite; ``<tool_call>`` -> hermes; ``[TOOL_CALLS]`` -> mistral; ``<|python_start|>`` or a pythonic
    call example (``[func_name1(``) -> pythonic; ``<|python_tag|>`` or the Llama 3 ``ipython``
    role -> llama3_json; otherwise None.
    """
    src = template_source or ""
    if "<|channel|>" in src and "<|message|>" in src:
        return "openai"
    if "<|tool_calls_section_begin|>" in src:
        return "kimi_k2"
    if "<｜tool▁calls▁begin｜>" in src:
        return "deepseek_v31" if "<｜tool▁sep｜>" in src and "```json" not in src else "deepseek_v3"
    if "<arg_key>" in src:
        return "glm45"
    if "<function=" in src and "<parameter=" in src:
        return "qwen3_coder"
    if "<|tool_call|>" in src:
        return "granite"
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_start|>" in src or "[func_name1(" in src:
        return "pythonic"
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama3_json"
    return None
