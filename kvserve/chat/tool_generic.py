"""The generic tool-call format: tools on any model, whatever its chat template renders.

llama-server's answer for a template without a tool-call format of its own
(``common_chat_params_init_generic`` in ``common/chat.cpp``): the tools are described in the
system prompt, and the output is constrained (not lazily: from the first token) to one JSON
object that is either a call or a reply:

* ``{"tool_call": {"name": ..., "arguments": {...}}}`` (``parallel_tool_calls`` false or a named
  function), ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` (parallel);
* ``{"response": "..."}`` (``tool_choice`` auto only; its value follows the request's JSON schema
  when one was given, else it is a string).

:class:`GenericToolParser` reads that object back: calls become OpenAI ``tool_calls``, a
``response`` becomes the message content (a non-string response is its JSON text). Output cut
off by ``max_tokens`` never shows the JSON: a partial ``response`` string is the content so far,
a partial call is dropped (no call, empty content). Streaming sends the ``response`` string as
it is generated and each call once the object is complete.
"""

from __future__ import annotations

import json
import logging

from kvserve.chat.tool_calls import ExtractedToolCalls, ToolCall, ToolParser, _canonical_args, _loads, _Malformed, _Obj

__all__ = ["GENERIC", "GenericToolParser", "generic_schema", "generic_system_text"]

logger = logging.getLogger(__name__)

#: the parser name the chat plan uses for the generic format (not a ``--tool-call-parser`` name)
GENERIC = "generic"

_RESPOND = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
            "reply to the user's request")
_RESPOND_CALL = "Respond in JSON format with `tool_call` (a request to call tools)"
_RESPOND_CALLS = "Respond in JSON format with `tool_calls` (a list of requests to call tools)"


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"]}


def generic_schema(tools: list[dict], choice: str | dict, parallel: bool, response_schema: dict | None = None) -> dict:
    """The JSON schema that constrains a generic-format answer (llama-server's, same keys).

    Args:
        tools: OpenAI tool definitions (validated: ``function.name`` is a string).
        choice: ``"auto"``, ``"required"`` or ``{"name": ...}`` (a named function: only that tool).
        parallel: ``tool_calls`` (a non-empty array) instead of one ``tool_call``.
        response_schema: the schema of ``response`` for ``auto`` (default: a string).
    """
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["name"]]
    calls = [_call_schema(t) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        call = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                "required": ["tool_calls"]}
    else:
        call = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"]}
    if choice != "auto":
        return call
    response = {"type": "object", "properties": {"response": response_schema or {"type": "string"}},
                "required": ["response"]}
    return {"anyOf": [call, response]}


def generic_system_text(tools: list[dict] | None, choice: str | dict, parallel: bool) -> str:
    """The system-prompt text for the generic format: the tools as JSON (when the template does
    not render them itself: ``tools`` not None) and how to answer."""
    if choice == "auto":
        how = _RESPOND
    else:
        how = _RESPOND_CALLS if parallel else _RESPOND_CALL
    if not tools:
        return how
    listed = json.dumps([t["function"] for t in tools], indent=2, ensure_ascii=False)
    return f"You can call any of the following tools to satisfy the user's requests: {listed}\n\n{how}"


def _partial_string(text: str) -> str:
    """The decoded characters of a JSON string body cut anywhere (no opening quote; stops at
    the closing quote; an escape cut in the middle is left out)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = 6 if text[i + 1:i + 2] == "u" else 2
        if i + n > len(text):
            break
        if n == 6 and _high_surrogate(text[i + 2:i + 6]):
            n = 12  # a surrogate pair: both halves or nothing
            if i + n > len(text):
                break
        try:
            out.append(json.loads('"' + text[i:i + n] + '"'))
        except ValueError:
            break
        i += n
    return "".join(out)


def _high_surrogate(hex4: str) -> bool:
    try:
        return 0xD800 <= int(hex4, 16) < 0xDC00
    except ValueError:
        return False


def _response_start(text: str) -> int:
    """Index after ``{"response": "`` at the start of ``text`` (whitespace allowed), -1 when it
    is not (yet) there."""
    i = 0
    for lit in ("{", '"response"', ":", '"'):
        while i < len(text) and text[i] in " \t\n\r":
            i += 1
        if not text.startswith(lit, i):
            return -1
        i += len(lit)
    return i


class GenericToolParser(ToolParser):
    """Reads the generic format's JSON object (see the module docstring)."""

    name = GENERIC
    rewrites_content = True

    def stream(self, incremental: bool = True) -> _GenericStreamer:  # type: ignore[override]
        """Streaming state: the response string as it comes, calls whole (``incremental`` ignored)."""
        return _GenericStreamer(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a finished (or cut-off) output: content or calls, never the raw JSON."""
        try:
            obj = _loads(text)
        except ValueError:
            at = _response_start(text)
            if at < 0:
                logger.warning("dropped an unfinished generic tool call")
            return ExtractedToolCalls(content=(_partial_string(text[at:]) if at >= 0 else "") or None)
        try:
            return self._from_object(obj)
        except _Malformed:
            logger.warning("Error in extracting tool call from response.")
            return ExtractedToolCalls(content=text or None)

    def _from_object(self, obj: object) -> ExtractedToolCalls:
        if not isinstance(obj, _Obj):
            raise _Malformed("not an object")
        d = dict(obj)
        if "response" in d:
            r = d["response"]
            return ExtractedToolCalls(content=(r if isinstance(r, str) else _plain_json(r)) or None)
        raw = d["tool_calls"] if "tool_calls" in d else [d.get("tool_call")]
        if not isinstance(raw, list) or not raw:
            raise _Malformed("no calls")
        calls = []
        for c in raw:
            if not isinstance(c, _Obj):
                raise _Malformed("call is not an object")
            cd = dict(c)
            if not isinstance(cd.get("name"), str) or not cd["name"]:
                raise _Malformed("call has no name")
            calls.append(ToolCall(name=cd["name"], arguments=_canonical_args(cd.get("arguments")), id=self.make_id()))
        return ExtractedToolCalls(content=None, calls=calls)


def _plain_json(v: object) -> str:
    def conv(x: object) -> object:
        if isinstance(x, _Obj):
            return {k: conv(y) for k, y in x}
        if isinstance(x, list):
            return [conv(y) for y in x]
        return x
    return json.dumps(conv(v), ensure_ascii=False)


class _GenericStreamer:
    """Streaming state of :class:`GenericToolParser` (the interface of
    :class:`kvserve.chat.tool_calls.ToolCallStreamer`)."""

    def __init__(self, parser: GenericToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._sent = 0  # characters of a string response already sent
        self._n = 0
        self.malformed = False

    @property
    def saw_calls(self) -> bool:
        return self._n > 0

    def feed(self, delta_text: str) -> list[dict]:
        self._text += delta_text
        at = _response_start(self._text)
        if at < 0:
            return []
        s = _partial_string(self._text[at:])
        new, self._sent = s[self._sent:], len(s)
        return [{"content": new}] if new else []

    def finish(self) -> list[dict]:
        res = self._parser.extract(self._text)
        if res.calls:
            self._n = len(res.calls)
            return [{"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}}]}
                    for k, c in enumerate(res.calls)]
        rest = (res.content or "")[self._sent:]  # a string response: what was not streamed yet
        return [{"content": rest}] if rest else []
