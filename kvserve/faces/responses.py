"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}`` (``POST /responses`` too, as
llama-server serves it).

The face translates: a Responses request becomes kvserve's
:class:`~kvserve.serving.chat_request.ChatRequest` (:func:`chat_body`, then :func:`chat_request`
once the model is known), planned by :func:`kvserve.serving.chat_plan.plan_chat`, so tools,
``tool_choice``, structured output and reasoning go through the same chat features; the serving
layer's answer events (:func:`kvserve.serving.choices.chat_events`: content, reasoning and tool-call
pieces, the finish reason, the usage) become the response object and its typed events.

Request -> chat request:

- ``instructions`` -> a first ``system`` message (not carried over by ``previous_response_id``,
  as OpenAI documents);
- ``input``: a string (one user message) or items: messages (``user``, ``assistant``,
  ``system``; ``developer`` becomes ``system``) with ``input_text``/``output_text`` parts,
  ``function_call`` items -> an assistant message's ``tool_calls`` (consecutive calls join one
  message), ``function_call_output`` -> a ``tool`` message, ``reasoning`` items -> the next
  assistant message's ``reasoning_content``. Images, files, audio and ``item_reference`` are 400;
- ``tools``: function tools (flat Responses shape) -> chat tools; any other tool type
  (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use_preview``, ``mcp``...)
  is 400 naming them. ``tool_choice``: ``none``/``auto``/``required``, ``{"type": "function",
  "name"}``, ``{"type": "allowed_tools", "mode", "tools"}`` (only those tools are offered);
- ``text.format``: ``json_schema``/``json_object`` -> the output constraint (the structured-output
  grammar); ``max_output_tokens`` -> the token limit; ``temperature``, ``top_p``,
  ``parallel_tool_calls`` as they are;
- ``reasoning.effort`` -> the template's ``reasoning_effort`` and a thinking budget
  (:data:`EFFORT_BUDGET`; ``none`` also sets ``enable_thinking: false``), never above
  ``--reasoning-budget``; ``reasoning.summary`` is echoed, no summary is written (the thinking
  itself is the reasoning item's ``reasoning_text``);
- kvserve's sampling extensions (``top_k``, ``min_p``, ``seed``, ``stop``...) are read with the
  chat route's checks once the model is known.

``store`` (default true) keeps the response in memory (:class:`ResponseStore`, bounded by
count and bytes, LRU) for GET/DELETE, the input-items list and ``previous_response_id``, which continues the stored
conversation: its earlier input and output come before the new input. A missing id is 404, and so
is another API key's response (:func:`owner_of`: each entry belongs to the key that created it).
Input items are stored with their known fields only; their ids must be unique strings. A client
value the response echoes (``tools[i].parameters``, ``text.format.schema``) nesting deeper than
:data:`MAX_ECHO_DEPTH` is 400, so no answer can fail to encode. ``GET`` does not stream
(``?stream=true`` is 400).
``background``, ``conversation``, ``prompt`` and ``top_logprobs`` are refused (400).

Streaming: ``event: <type>`` + ``data: {...}`` per event, ``sequence_number`` from 0:
response.created, response.in_progress, then per output item output_item.added,
(content_part.added, output_text.delta..., output_text.done, content_part.done) or
(function_call_arguments.delta, function_call_arguments.done) or (content_part.added,
reasoning_text.delta..., reasoning_text.done, content_part.done), output_item.done; last
response.completed (response.incomplete when max_output_tokens cut it, response.failed on an
engine error). No ``[DONE]``. Errors found before the first event are plain JSON errors; without
``stream`` an engine error is the HTTP error the chat route would answer (the failed response is
still stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.faces.auth import request_key
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import dumps, error_response, json_response, read_json
from kvserve.faces.models import keep_alive_field, model_field, serve_model
from kvserve.errors import InvalidInputError
from kvserve.faces.auth import caller
from kvserve.faces.chat_features import check_tool_choice, parse_tools, read_reasoning_options, read_template_options
from kvserve.faces.params import get_bool, get_int, get_str, sampling_fields, slot_view, type_error
from kvserve.faces.responses_types import (
    ContentPartAdded,
    ContentPartDone,
    DeletedResponse,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ResponseInputTokens,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseError,
    ResponseLifecycle,
    ResponseUsage,
)
from kvserve.faces.responses_types import Response as ResponseObject
from kvserve.faces.sse import (
    ClientDisconnected,
    error_answer,
    error_body,
    sse_named,
    sse_response,
    until_disconnect,
)
from kvserve.serving.chat_plan import plan_chat
from kvserve.serving.chat_request import ChatRequest, StreamOptions, TemplateOptions
from kvserve.serving.chat_output import Piece, ReasoningPiece, TextPiece, ToolCallPiece
from kvserve.serving.choices import ChatUsage, chat_events
from kvserve.serving.ids import HEX, new_id
from kvserve.serving.response_store import ResponseStore
from kvserve.structured.spec import ConstraintSpec, schema_spec
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServerState

__all__ = ["EFFORT_BUDGET", "MAX_ECHO_DEPTH", "MAX_INPUT_ITEMS", "build_router", "chat_body", "owner_of"]

#: at most this many ``input`` items per request
MAX_INPUT_ITEMS = 4096
#: deepest nesting (arrays and objects) of a client value the response echoes (``tools[i].parameters``,
#: ``text.format.schema``) or parses (a ``function_call``'s ``arguments``): far above any real schema, far
#: below the ~1000 levels where Python's JSON encoder (and recursive schema walkers) fail
MAX_ECHO_DEPTH = 128
#: ``reasoning.effort`` -> thinking tokens before ``</think>`` is forced (-1: no limit)
EFFORT_BUDGET = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": -1, "xhigh": -1}
#: OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512
_META_PAIRS, _META_KEY, _META_VALUE = 16, 64, 512
#: kvserve's own request fields (llama-server's and vLLM's names), read when the model is known
#: (:func:`chat_request`: ``logit_bias`` text keys need its vocabulary, the reasoning fields its flags)
_PASSTHROUGH = ("top_k", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                "frequency_penalty", "seed", "stop", "logit_bias", "cache_salt", "id_slot",
                "thinking_token_budget", "reasoning_format", "include_reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _responses_id(prefix: str) -> str:
    """The Responses API's ids: ``resp_`` / ``msg_`` / ``rs_`` / ``fc_`` / ``call_`` + 48 hex digits."""
    return new_id(prefix, 48, HEX)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param) if param else ApiError(400, message)


# ------------------------------------------------------------------------ request -> chat body


@dataclass
class Turn:
    """One Responses request, translated.

    Attributes:
        chat: kvserve's chat request, all but the fields that need the model (:func:`chat_request`
            completes it).
        fields: those fields as sent (:data:`_PASSTHROUGH`, ``temperature``, ``top_p``, the
            template variables).
        history: the conversation to store after this turn's output (earlier turns and this
            input, instructions left out), as chat messages.
        echo: the request's settings as the response object writes them (instructions,
            max_output_tokens, previous_response_id, reasoning, store, text, tool_choice,
            tools, truncation, user, metadata, parallel_tool_calls).
        stream: the request asked for SSE.
        store: keep the response in the store.
        input_items: the request's ``input`` as ``GET /v1/responses/{id}/input_items`` lists it.
        owner: who created it (:func:`owner_of`); only they see the stored response.
    """

    chat: ChatRequest
    fields: dict
    history: list[dict]
    echo: dict
    stream: bool = False
    store: bool = True
    input_items: list[dict] = field(default_factory=list)
    owner: str = ""


def _obj(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise type_error(where, "object", v)
    return v


def _str_field(d: dict, key: str, where: str, *, required: bool = True) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise _bad(f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}")
        return None
    if not isinstance(v, str):
        raise type_error(f"{where}.{key}", "string", v)
    return v


def _parts_text(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    """A message's (or tool output's) content as text: a string, or text parts joined with
    newlines; images, files and audio are 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(where, "string or array", content)
    texts = []
    for j, part in enumerate(content):
        p = _obj(part, f"{where}[{j}]")
        kind = p.get("type")
        if kind == "refusal" and "refusal" in allowed:
            texts.append(_str_field(p, "refusal", f"{where}[{j}]") or "")
        elif kind in allowed and kind != "refusal":
            texts.append(_str_field(p, "text", f"{where}[{j}]") or "")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}]: content type '{kind}' is not supported: kvserve's models read text only",
                       f"{where}[{j}].type")
        else:
            raise _bad(f"{where}[{j}]: unknown content type {kind!r}", f"{where}[{j}].type")
    return "\n".join(texts)


def _depth(v: Any) -> int:
    """The nesting depth of a JSON value (a scalar 0, ``{}`` or ``[]`` 1), walked without recursion."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, list):
            continue
        deepest = max(deepest, d)
        if d <= MAX_ECHO_DEPTH:  # deeper than the limit is refused: no need to walk further
            stack.extend((y, d + 1) for y in x if isinstance(y, (dict, list)))
    return deepest


def _check_depth(v: Any, where: str) -> None:
    """400 naming ``where`` when ``v`` nests deeper than :data:`MAX_ECHO_DEPTH`."""
    if _depth(v) > MAX_ECHO_DEPTH:
        raise _bad(f"Field '{where}': nested deeper than {MAX_ECHO_DEPTH} levels", where)


def _no_constant(name: str):
    raise ValueError(name)


def _json_object_text(v: Any, where: str) -> str:
    """``v`` when it is a JSON object's text (RFC 8259: no NaN or Infinity; blank counts as ``{}``),
    nested at most :data:`MAX_ECHO_DEPTH` deep; else 400 naming ``where``."""
    if not isinstance(v, str):
        raise type_error(where, "string", v)
    try:
        parsed = json.loads(v, parse_constant=_no_constant) if v.strip() else {}
    except RecursionError:
        raise _bad(f"Field '{where}': nested deeper than {MAX_ECHO_DEPTH} levels", where) from None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _bad(f"{where}: expected a JSON object as text, got {v[:80]!r}", where)
    _check_depth(parsed, where)
    return v


class _Conversation:
    """Builds chat messages from Responses input items, in order."""

    def __init__(self, history: list[dict]):
        self.messages: list[dict] = []
        self.pending_reasoning: str | None = None
        self.call_names = {c.get("id"): c["function"]["name"] for m in history for c in m.get("tool_calls") or []}

    def add(self, item: Any, where: str) -> None:
        it = _obj(item, where)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            self._message(it, where)
        elif kind == "function_call":
            self._call(it, where)
        elif kind == "function_call_output":
            self._output(it, where)
        elif kind == "reasoning":
            self._reasoning(it, where)
        elif kind == "item_reference":
            raise _bad(f"{where}: 'item_reference' is not supported: send the item itself or use "
                       f"previous_response_id", f"{where}.type")
        elif kind is None:
            raise _bad(f"Missing required parameter: '{where}.type'.", f"{where}.type")
        else:
            raise _bad(f"{where}: item type {str(kind)[:64]!r} is not supported", f"{where}.type")

    def _message(self, it: dict, where: str) -> None:
        role = it.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"{where}.role: expected 'user', 'assistant', 'system' or 'developer', got {role!r}",
                       f"{where}.role")
        allowed = _TEXT_PARTS + ("refusal",) if role == "assistant" else _TEXT_PARTS
        if "content" not in it:
            raise _bad(f"Missing required parameter: '{where}.content'.", f"{where}.content")
        text = _parts_text(it["content"], f"{where}.content", allowed)
        msg = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and self.pending_reasoning is not None:
            msg["reasoning_content"] = self.pending_reasoning
        self.pending_reasoning = None
        self.messages.append(msg)

    def _call(self, it: dict, where: str) -> None:
        call_id = _str_field(it, "call_id", where)
        name = _str_field(it, "name", where)
        if not name:
            raise _bad(f"{where}.name: expected a non-empty string", f"{where}.name")
        args = _json_object_text(it.get("arguments", "{}"), f"{where}.arguments")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        self.call_names[call_id] = name
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.pending_reasoning is None:
            last.setdefault("tool_calls", []).append(call)
            return
        msg = {"role": "assistant", "content": "", "tool_calls": [call]}
        if self.pending_reasoning is not None:
            msg["reasoning_content"] = self.pending_reasoning
            self.pending_reasoning = None
        self.messages.append(msg)

    def _output(self, it: dict, where: str) -> None:
        call_id = _str_field(it, "call_id", where)
        if "output" not in it:
            raise _bad(f"Missing required parameter: '{where}.output'.", f"{where}.output")
        text = _parts_text(it["output"], f"{where}.output", _TEXT_PARTS)
        msg = {"role": "tool", "tool_call_id": call_id, "content": text}
        if call_id in self.call_names:
            msg["name"] = self.call_names[call_id]
        self.messages.append(msg)

    def _reasoning(self, it: dict, where: str) -> None:
        texts = []
        for key in ("content", "summary"):
            parts = it.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise type_error(f"{where}.{key}", "array", parts)
            for j, p in enumerate(parts):
                texts.append(_str_field(_obj(p, f"{where}.{key}[{j}]"), "text", f"{where}.{key}[{j}]") or "")
            if texts:
                break  # the raw thinking when given, else its summary
        self.pending_reasoning = "\n".join(texts)


def input_messages(inp: Any, history: list[dict]) -> list[dict]:
    """``input`` (a string or a list of items) as chat messages (400 naming ``input[i]...``)."""
    if inp is None:
        return []
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise type_error("input", "string or array", inp)
    if len(inp) > MAX_INPUT_ITEMS:
        raise _bad(f"Field 'input': at most {MAX_INPUT_ITEMS} items, got {len(inp)}", "input")
    conv = _Conversation(history)
    for i, item in enumerate(inp):
        conv.add(item, f"input[{i}]")
    return conv.messages


_ITEM_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
_STATUSES = ("in_progress", "completed", "incomplete")


def check_item_ids(inp: Any) -> None:
    """Item ids, where given, are strings and unique in the request (as OpenAI: 400
    ``Duplicate item found with id ...``), so that the input-items list pages by id.

    Raises:
        ApiError: 400 naming ``input[i].id`` (not a string) or ``input`` (a duplicate).
    """
    if not isinstance(inp, list):
        return
    seen: set[str] = set()
    for i, it in enumerate(inp):
        item_id = it.get("id") if isinstance(it, dict) else None
        if item_id is None:
            continue
        if not isinstance(item_id, str):
            raise type_error(f"input[{i}].id", "string", item_id)
        if item_id in seen:
            raise _bad(f"Duplicate item found with id {item_id[:128]}. Remove duplicate items from your input and "
                       f"try again.", "input")
        seen.add(item_id)


def _listed_parts(content: Any, role: str | None) -> list[dict]:
    """Content (a string or text parts, already checked) as listed parts, known fields only."""
    if isinstance(content, str):
        return [{"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                else {"type": "input_text", "text": content}]
    parts = []
    for p in content:
        kind = p["type"]
        if kind == "refusal":
            parts.append({"type": "refusal", "refusal": p.get("refusal") or ""})
        elif kind == "output_text":
            parts.append({"type": "output_text", "text": p.get("text") or "", "annotations": []})
        else:
            parts.append({"type": kind, "text": p.get("text") or ""})
    return parts


def _listed_item(it: dict) -> dict:
    """One (checked) input item as listed: its known fields only, normalized (unknown keys are
    dropped: a stored item costs only what the list shows)."""
    kind = it.get("type") or "message"
    item_id = it.get("id") or _responses_id(_ITEM_ID_PREFIX.get(kind, "item_"))
    status = it.get("status") if it.get("status") in _STATUSES else "completed"
    if kind == "message":
        return {"id": item_id, "type": "message", "role": it["role"],
                "content": _listed_parts(it["content"], it["role"]), "status": status}
    if kind == "function_call":
        return {"id": item_id, "type": "function_call", "call_id": it["call_id"], "name": it["name"],
                "arguments": it.get("arguments", "{}"), "status": status}
    if kind == "function_call_output":
        out = it["output"]
        return {"id": item_id, "type": "function_call_output", "call_id": it["call_id"],
                "output": out if isinstance(out, str) else _listed_parts(out, None), "status": status}
    d: dict = {"id": item_id, "type": "reasoning"}  # reasoning: no status, as OpenAI lists it
    for key in ("summary", "content"):
        if it.get(key) is not None:
            kind = "summary_text" if key == "summary" else "reasoning_text"
            d[key] = [{"type": kind, "text": p.get("text") or ""} for p in it[key]]
    d.setdefault("summary", [])
    if isinstance(it.get("encrypted_content"), str):
        d["encrypted_content"] = it["encrypted_content"]
    return d


def listed_input_items(inp: Any) -> list[dict]:
    """A (valid, see :func:`input_messages`) ``input`` as the input-items list writes it: each
    item with an ``id`` first (the client's, else a new one), its ``type``, message text as
    ``input_text`` (``output_text`` for the assistant) parts and ``status`` (completed unless
    the client gave one); only the fields the Responses API defines for the item are kept."""
    if inp is None:
        return []
    if isinstance(inp, str):
        inp = [{"type": "message", "role": "user", "content": inp}]
    return [_listed_item(it) for it in inp]


_BUILTIN_HINT = "kvserve runs function tools only; built-in tools run on OpenAI's servers"


def _tools(body: dict) -> tuple[list[dict], list[dict]]:
    """``tools`` -> (chat tools, the tools echoed in the response)."""
    tools = body.get("tools")
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise type_error("tools", "array", tools)
    others = []
    for i, t in enumerate(tools):
        kind = _obj(t, f"tools[{i}]").get("type")
        if kind != "function":
            others.append(str(kind)[:64])
    if others:
        raise _bad(f"tools: tool type(s) {', '.join(repr(k) for k in others)} not supported: {_BUILTIN_HINT}",
                   "tools")
    chat, echo = [], []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        name = _str_field(t, "name", where)
        if not name:
            raise _bad(f"{where}.name: expected a non-empty string", f"{where}.name")
        desc = _str_field(t, "description", where, required=False)
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise type_error(f"{where}.parameters", "object", params)
        _check_depth(params, f"{where}.parameters")
        strict = t.get("strict", True)
        if not isinstance(strict, bool):
            raise type_error(f"{where}.strict", "boolean", strict)
        fn: dict = {"name": name}
        if desc is not None:
            fn["description"] = desc
        if params is not None:
            fn["parameters"] = params
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": desc, "parameters": params, "strict": strict})
    return chat, echo


def _tool_choice(body: dict, chat_tools: list[dict]) -> tuple[Any, Any, list[dict]]:
    """``tool_choice`` -> (the chat request's tool choice or None (the default), the echoed value,
    the tools offered)."""
    tc = body.get("tool_choice")
    if tc is None:
        return None, "auto", chat_tools
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise _bad(f"Field 'tool_choice': expected 'none', 'auto', 'required' or an object, got {tc[:64]!r}",
                       "tool_choice")
        return tc, tc, chat_tools
    d = _obj(tc, "tool_choice")
    kind = d.get("type")
    if kind == "function":
        name = _str_field(d, "name", "tool_choice")
        return {"name": name}, {"type": "function", "name": name}, chat_tools
    if kind == "allowed_tools":
        mode = d.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise _bad(f"Field 'tool_choice.mode': expected 'auto' or 'required', got {mode!r}", "tool_choice.mode")
        allowed = d.get("tools")
        if not isinstance(allowed, list):
            raise type_error("tool_choice.tools", "array", allowed)
        names: list[str] = []
        for j, a in enumerate(allowed):
            a = _obj(a, f"tool_choice.tools[{j}]")
            if a.get("type") != "function":
                raise _bad(f"tool_choice.tools[{j}]: tool type {a.get('type')!r} not supported: {_BUILTIN_HINT}",
                           f"tool_choice.tools[{j}].type")
            names.append(_str_field(a, "name", f"tool_choice.tools[{j}]"))
        wanted = set(names)  # a set: 20,000 tools against 20,000 names must not be N x M
        offered = [t for t in chat_tools if t["function"]["name"] in wanted]
        echo = {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": n} for n in names]}
        return mode, echo, offered
    raise _bad(f"Field 'tool_choice': type {str(kind)[:64]!r} not supported: {_BUILTIN_HINT}", "tool_choice.type")


def _text_format(body: dict) -> tuple[ConstraintSpec | None, dict]:
    """``text`` -> (the output constraint or None, the echoed ``text``). A schema's errors name
    ``response_format.json_schema.schema``, as when this face planned through a chat body."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    text = _obj(text, "text")
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise _bad(f"Field 'text.verbosity': expected 'low', 'medium' or 'high', got {verbosity!r}", "text.verbosity")
    fmt = text.get("format")
    # the echo holds the known fields only (a client's extra keys are not written back)
    echo: dict = {"format": {"type": "text"}}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    if fmt is None:
        return None, echo
    fmt = _obj(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None, echo
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return ConstraintSpec("json_object", ""), echo
    if kind == "json_schema":
        name = _str_field(fmt, "name", "text.format")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("Missing required parameter: 'text.format.schema'." if schema is None else
                       "Field 'text.format.schema': expected a JSON schema object", "text.format.schema")
        _check_depth(schema, "text.format.schema")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise type_error("text.format.strict", "boolean", strict)
        desc = _str_field(fmt, "description", "text.format", required=False)
        echo["format"] = {"type": "json_schema", "name": name, "schema": schema}
        if desc is not None:
            echo["format"]["description"] = desc
        if strict is not None:
            echo["format"]["strict"] = strict
        try:
            return schema_spec(schema, "response_format.json_schema.schema"), echo
        except InvalidInputError as e:
            raise ApiError(400, str(e)) from None
    raise _bad(f"Field 'text.format.type': expected 'text', 'json_object' or 'json_schema', got {kind!r}",
               "text.format.type")


def _reasoning(body: dict, chat: ChatRequest, fields: dict, server_budget: int) -> dict:
    """``reasoning`` -> the reasoning effort and thinking budget of ``chat`` (``none`` switches
    thinking off in ``fields``' template variables); returns the echo."""
    r = body.get("reasoning")
    if r is None:
        return {"effort": None, "summary": None}
    r = _obj(r, "reasoning")
    effort = r.get("effort")
    summary = r.get("summary", r.get("generate_summary"))
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORT_BUDGET):
        raise _bad(f"Field 'reasoning.effort': expected one of {', '.join(EFFORT_BUDGET)}, got {effort!r}",
                   "reasoning.effort")
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise _bad(f"Field 'reasoning.summary': expected 'auto', 'concise' or 'detailed', got {summary!r}",
                   "reasoning.summary")
    if effort is not None:
        chat.reasoning.effort = effort
        if effort == "none":
            kwargs = dict(fields.get("chat_template_kwargs") or {})
            kwargs.setdefault("enable_thinking", False)
            fields["chat_template_kwargs"] = kwargs
        if "thinking_token_budget" not in fields:
            budget = EFFORT_BUDGET[effort]
            if server_budget >= 0:
                budget = server_budget if budget < 0 else min(budget, server_budget)
            chat.reasoning.budget = budget
    return {"effort": effort, "summary": summary}


def _metadata(body: dict) -> dict[str, str]:
    meta = body.get("metadata")
    if meta is None:
        return {}
    meta = _obj(meta, "metadata")
    if len(meta) > _META_PAIRS:
        raise _bad(f"Field 'metadata': at most {_META_PAIRS} pairs", "metadata")
    for k, v in meta.items():
        if len(k) > _META_KEY:
            raise _bad(f"Field 'metadata': keys are at most {_META_KEY} characters", "metadata")
        if not isinstance(v, str):
            raise type_error(f"metadata.{k[:_META_KEY]}", "string", v)
        if len(v) > _META_VALUE:
            raise _bad(f"Field 'metadata.{k}': values are at most {_META_VALUE} characters", "metadata")
    return dict(meta)


def _refuse(body: dict) -> None:
    if get_bool(body, "background", False):
        raise _bad("'background' is not supported: kvserve answers while the request is open", "background")
    if body.get("conversation") is not None:
        raise _bad("'conversation' is not supported: use previous_response_id", "conversation")
    if body.get("prompt") is not None:
        raise _bad("'prompt' (stored prompt templates) is not supported", "prompt")
    top = get_int(body, "top_logprobs")
    if top:
        raise _bad("'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)", "top_logprobs")


def _max_output_tokens(body: dict) -> int | None:
    v = body.get("max_output_tokens")
    if isinstance(v, float) and v.is_integer() is False:
        raise _bad(f"Field 'max_output_tokens': expected an integer, got {v!r}", "max_output_tokens")
    n = get_int(body, "max_output_tokens")
    if n is not None and n < 1:
        raise _bad("Field 'max_output_tokens': must be >= 1", "max_output_tokens")
    return n


def chat_body(body: dict, store: ResponseStore, server_budget: int = -1, owner: str = "") -> Turn:
    """Translate a Responses request into kvserve's chat request (a :class:`Turn`; the fields that
    need the model are read by :func:`chat_request` once it is known).

    CPU work linear in the body's size (the face runs it on a worker thread).

    Args:
        body: the request JSON object.
        store: where ``previous_response_id`` is looked up.
        server_budget: ``--reasoning-budget`` (-1: none), the cap of an effort's budget.
        owner: who asks (:func:`owner_of`): another owner's response is not found.

    Raises:
        ApiError: 400 naming a bad or unsupported field; 404 for a ``previous_response_id``
            that is not stored (never stored, deleted, or evicted).
    """
    _refuse(body)
    stream = bool(get_bool(body, "stream", False))
    keep = get_bool(body, "store", True)
    prev_id = get_str(body, "previous_response_id")
    history = _history(store, prev_id, owner)
    instructions = get_str(body, "instructions")
    check_item_ids(body.get("input"))
    new = input_messages(body.get("input"), history)
    if not new and not history:
        raise _bad("Missing required parameter: 'input'.", "input")
    system = [{"role": "system", "content": instructions}] if instructions else []
    # the face reads the answer as a stream of chat chunks, usage last
    chat = ChatRequest(system + history + new, new_id("chatcmpl-"),
                       stream=StreamOptions(stream=True, include_usage=True),
                       template=TemplateOptions(continue_final_message=False))
    fields = {key: body[key] for key in (*_PASSTHROUGH, "chat_template_kwargs", "temperature", "top_p")
              if body.get(key) is not None}
    max_out = _max_output_tokens(body)
    if max_out is not None:
        chat.sampling["n_predict"] = max_out
    chat_tools, echo_tools = _tools(body)
    choice, echo_choice, offered = _tool_choice(body, chat_tools)
    parallel = get_bool(body, "parallel_tool_calls", True)
    _tool_fields(chat, offered, choice, parallel)
    chat.response_format, echo_text = _text_format(body)
    echo_reasoning = _reasoning(body, chat, fields, server_budget)
    truncation = get_str(body, "truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise _bad(f"Field 'truncation': expected 'auto' or 'disabled', got {truncation[:64]!r}", "truncation")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise type_error("include", "array of strings", include)
    echo = {"instructions": instructions, "max_output_tokens": max_out, "parallel_tool_calls": parallel,
            "previous_response_id": prev_id, "reasoning": echo_reasoning, "store": keep, "text": echo_text,
            "tool_choice": echo_choice, "tools": echo_tools, "truncation": truncation,
            "user": get_str(body, "user"), "metadata": _metadata(body)}
    return Turn(chat, fields, history + new, echo, stream, keep,
                listed_input_items(body.get("input")) if keep else [], owner)


def _history(store: ResponseStore, prev_id: str | None, owner: str) -> list[dict]:
    """The stored conversation ``previous_response_id`` continues ([] without one; 404 when it is
    not stored for ``owner``)."""
    if prev_id is None:
        return []
    entry = store.get(prev_id, owner)
    if entry is None:
        raise ApiError(404, f"Previous response with id '{prev_id[:128]}' not found.", param="previous_response_id")
    return [dict(m) for m in entry.history]


def _tool_fields(chat: ChatRequest, offered: list[dict], choice: Any, parallel: bool | None) -> None:
    """The offered tools, the tool choice (default: ``auto`` with tools, else ``none``) and parallel
    calls (default true); their bounds and agreement are checked with the model (:func:`chat_request`)."""
    chat.tools = offered or None
    chat.tool_choice = choice if choice is not None else ("auto" if offered else "none")
    chat.parallel_tool_calls = True if parallel is None else parallel


def chat_request(runner: Runner, turn: Turn) -> ChatRequest:
    """``turn.chat`` completed with the fields that need the model (checked as the chat route
    checks them): the tools and tool choice, the sampling fields, the template variables and the
    reasoning fields."""
    chat, fields = turn.chat, turn.fields
    tools = parse_tools(chat.tools)
    choice = check_tool_choice(chat.tool_choice, tools)
    sampling = sampling_fields(fields, runner.tokenizer, max_tokens_keys=(), max_logprobs=runner.args.max_logprobs)
    opts = read_template_options(fields)
    reasoning = read_reasoning_options(runner.args, fields)
    budget = chat.reasoning.budget if reasoning.budget is None else reasoning.budget
    id_slot = get_int(fields, "id_slot", -1)
    return dataclasses.replace(
        chat, tools=tools, tool_choice=choice, sampling={**sampling, **chat.sampling},
        template=dataclasses.replace(chat.template, variables=opts.variables, documents=opts.documents),
        reasoning=dataclasses.replace(reasoning, budget=budget, effort=chat.reasoning.effort),
        id_slot=-1 if id_slot is None else id_slot, cache_salt=get_str(fields, "cache_salt") or None, owner=caller())


# ------------------------------------------------------------------------ chat chunks -> response


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # "message" | "reasoning"
    index: int
    id: str
    text: str = ""


@dataclass
class _Run:
    """One response being produced: turns the serving layer's chat events into the Responses
    API's events and the response object."""

    runner: Runner
    plan: Any
    turn: Turn
    store: ResponseStore
    response_id: str = field(default_factory=lambda: _responses_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    output: list = field(default_factory=list)
    open: _Open | None = None
    pending: str = ""  # whitespace not yet in a message (between tool calls it is dropped)
    finish: str | None = None
    usage: ChatUsage | None = None
    status: str = "in_progress"
    error: ResponseError | None = None
    failure: Exception | None = None  # what failed the response (a non-streamed answer raises it)
    final: dict | None = None

    # -- events ------------------------------------------------------------------------

    def _ev(self, cls, **fields) -> dict:
        ev = cls(sequence_number=self.seq, **fields).wire()
        self.seq += 1
        return ev

    def response(self) -> ResponseObject:
        """The response object as it is now."""
        e = self.turn.echo
        params = self.plan.requests[0].params
        incomplete = IncompleteDetails(reason="max_output_tokens") if self.status == "incomplete" else None
        return ResponseObject(
            id=self.response_id, object="response", created_at=self.created_at, status=self.status,
            error=self.error, incomplete_details=incomplete, instructions=e["instructions"],
            max_output_tokens=e["max_output_tokens"], model=self.plan.model, output=list(self.output),
            parallel_tool_calls=e["parallel_tool_calls"], previous_response_id=e["previous_response_id"],
            reasoning=e["reasoning"], store=e["store"], temperature=float(params.temperature), text=e["text"],
            tool_choice=e["tool_choice"], tools=e["tools"], top_p=float(params.top_p), truncation=e["truncation"],
            usage=self._usage(), user=e["user"], metadata=e["metadata"])

    def _life(self, kind: str) -> dict:
        return self._ev(ResponseLifecycle, type=kind, response=self.response())

    def _usage(self) -> ResponseUsage | None:
        u = self.usage
        if u is None:
            return None
        return ResponseUsage(input_tokens=u.prompt_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens, cache_write_tokens=0),
                             output_tokens=u.completion_tokens,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=u.reasoning_tokens or 0),
                             total_tokens=u.prompt_tokens + u.completion_tokens)

    async def events(self) -> AsyncIterator[dict]:
        """Every event of the response, in order (the last one holds the final response)."""
        # the whole response (echoing maybe 20,000 tools) is built on a worker thread
        yield await asyncio.to_thread(self._life, "response.created")
        yield await asyncio.to_thread(self._life, "response.in_progress")
        try:
            # closed with this generator (a client that leaves): its generations are aborted
            async with contextlib.aclosing(chat_events(self.runner, self.plan, slot_view(self.plan.grammar))) as evs:
                async for ev in evs:
                    self.usage = ev.usage or self.usage
                    if ev.finish_reason is not None:  # an answer that called tools is complete, never cut
                        self.finish = "stop" if ev.called_tools else ev.finish_reason
                    for p in ev.pieces:
                        for out in self._piece(p):
                            yield out
            for ev in self._finish():
                yield ev
            self.status = "incomplete" if self.finish == "length" else "completed"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an engine error ends the response as failed
            err = ApiError.from_exception(e)
            error_body(e)  # logs server faults (with their traceback)
            self.failure = e
            if self.open is not None:  # the item cut short is kept, with what it had
                self._finished_item(self.open, "incomplete")
                self.open = None
            self.status = "failed"
            self.error = ResponseError(code=err.type, message=err.message)
        last = await asyncio.to_thread(self._life, "response." + self.status)
        self.final = last["response"]
        if self.turn.store:  # serializing a large entry is CPU work: off the event loop
            await asyncio.to_thread(self._save)
        yield last

    def _save(self) -> None:
        self.store.put(self.response_id, self.final, self.turn.history + [self._assistant_message()],
                       self.turn.input_items, self.turn.owner)

    def _assistant_message(self) -> dict:
        """This turn's output as one chat message (for a later previous_response_id)."""
        texts, reasoning, calls = [], [], []
        for item in self.output:
            if isinstance(item, OutputMessage):
                texts.append("".join(p.text for p in item.content))
            elif isinstance(item, ReasoningItem):
                reasoning.append("".join(p.text for p in item.content))
            else:
                calls.append({"id": item.call_id, "type": "function",
                              "function": {"name": item.name, "arguments": item.arguments}})
        msg: dict = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        return msg

    # -- answer pieces -> items ----------------------------------------------------------

    def _piece(self, p: Piece) -> list[dict]:
        """The events of one piece of the answer: reasoning and text go to the open item of their
        kind, a tool call is a ``function_call`` item."""
        if type(p) is ReasoningPiece:
            return self._text("reasoning", p.text) if p.text else []
        if type(p) is TextPiece:
            return self._text("message", p.text) if p.text else []
        return self._call(p)

    def _text(self, kind: str, text: str) -> list[dict]:
        evs: list[dict] = []
        if self.open is not None and self.open.kind != kind:
            evs += self._close("completed")
        if self.open is None:
            if kind == "message" and not text.strip():
                self.pending += text
                return evs
            evs += self._start(kind)
            if kind == "message":
                text, self.pending = self.pending + text, ""
        o = self.open
        o.text += text
        cls = OutputTextDelta if kind == "message" else ReasoningTextDelta
        extra = {"logprobs": []} if kind == "message" else {}
        evs.append(self._ev(cls, type=f"response.{'output' if kind == 'message' else 'reasoning'}_text.delta",
                            item_id=o.id, output_index=o.index, content_index=0, delta=text, **extra))
        return evs

    def _start(self, kind: str) -> list[dict]:
        index = len(self.output)
        if kind == "message":
            o = _Open(kind, index, _responses_id("msg_"))
            item = OutputMessage(type="message", id=o.id, status="in_progress", role="assistant", content=[])
            part = OutputText(type="output_text", text="", annotations=[])
        else:
            self.pending = ""
            o = _Open(kind, index, _responses_id("rs_"))
            item = ReasoningItem(type="reasoning", id=o.id, summary=[], content=[], status="in_progress")
            part = ReasoningText(type="reasoning_text", text="")
        self.open = o
        self.output.append(item)
        return [self._ev(OutputItemAdded, type="response.output_item.added", output_index=index, item=item),
                self._ev(ContentPartAdded, type="response.content_part.added", item_id=o.id, output_index=index,
                         content_index=0, part=part)]

    def _finished_item(self, o: _Open, status: str):
        """The item ``o`` with its whole text and ``status``, put in its place in the output."""
        if o.kind == "message":
            part = OutputText(type="output_text", text=o.text, annotations=[])
            item = OutputMessage(type="message", id=o.id, status=status, role="assistant", content=[part])
        else:
            part = ReasoningText(type="reasoning_text", text=o.text)
            item = ReasoningItem(type="reasoning", id=o.id, summary=[], content=[part], status=status)
        self.output[o.index] = item
        return item, part

    def _close(self, status: str) -> list[dict]:
        o, self.open = self.open, None
        item, part = self._finished_item(o, status)
        if o.kind == "message":
            done = self._ev(OutputTextDone, type="response.output_text.done", item_id=o.id, output_index=o.index,
                            content_index=0, text=o.text, logprobs=[])
        else:
            done = self._ev(ReasoningTextDone, type="response.reasoning_text.done", item_id=o.id,
                            output_index=o.index, content_index=0, text=o.text)
        return [done,
                self._ev(ContentPartDone, type="response.content_part.done", item_id=o.id, output_index=o.index,
                         content_index=0, part=part),
                self._ev(OutputItemDone, type="response.output_item.done", output_index=o.index, item=item)]

    def _call(self, call: ToolCallPiece) -> list[dict]:
        evs = self._close("completed") if self.open is not None else []
        self.pending = ""
        index, item_id, args = len(self.output), _responses_id("fc_"), call.arguments or ""
        item = FunctionCallItem(type="function_call", id=item_id, call_id=call.id or _responses_id("call_"),
                                name=call.name or "", arguments="", status="in_progress")
        self.output.append(item)
        evs.append(self._ev(OutputItemAdded, type="response.output_item.added", output_index=index, item=item))
        evs.append(self._ev(FunctionCallArgumentsDelta, type="response.function_call_arguments.delta",
                            item_id=item_id, output_index=index, delta=args))
        evs.append(self._ev(FunctionCallArgumentsDone, type="response.function_call_arguments.done",
                            item_id=item_id, output_index=index, arguments=args))
        item = item.model_copy(update={"arguments": args, "status": "completed"})
        self.output[index] = item
        evs.append(self._ev(OutputItemDone, type="response.output_item.done", output_index=index, item=item))
        return evs

    def _finish(self) -> list[dict]:
        """Close the open item; an answer with no message and no call gets its (blank) text as
        a message, so that every finished response has something to read."""
        status = "incomplete" if self.finish == "length" else "completed"
        evs = self._close(status) if self.open is not None else []
        has_text_or_call = any(isinstance(i, (OutputMessage, FunctionCallItem)) for i in self.output)
        if not has_text_or_call:
            evs += self._start("message")
            self.open.text = self.pending
            self.pending = ""
            if self.open.text:
                evs.append(self._ev(OutputTextDelta, type="response.output_text.delta", item_id=self.open.id,
                                    output_index=self.open.index, content_index=0, delta=self.open.text,
                                    logprobs=[]))
            evs += self._close(status)
        return evs


# ------------------------------------------------------------------------ routes


def owner_of(state: ServerState, http: HttpRequest) -> str:
    """Who a request is, for the store: a hash of its API key when the server has keys (the key
    middleware let only valid ones through), else ``""`` (one shared owner). A response is
    visible (GET, input items, DELETE, ``previous_response_id``) to the key that created it only."""
    if not state.args.api_keys:
        return ""
    key = request_key(dict(http.scope.get("headers") or []))
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).hexdigest()


async def _create(state: ServerState, store: ResponseStore, http: HttpRequest) -> Response:
    try:
        body = await read_json(http)
        # translation is linear in the body, but a large body is still seconds of CPU: off the loop
        turn = await asyncio.to_thread(chat_body, body, store, state.args.reasoning_budget, owner_of(state, http))

        async def run(runner: Runner) -> Response:
            # rendering, tokenizing and grammar compiles are CPU work: off the event loop
            plan = await asyncio.to_thread(plan_chat, runner, chat_request(runner, turn))
            job = _Run(runner, plan, turn, store)
            if turn.stream:
                return await sse_response(job.events(), ping_interval=state.args.sse_ping_interval, done=False,
                                          encode=sse_named, headers={"X-Accel-Buffering": "no"})

            async def whole() -> dict:
                async for _ in job.events():
                    pass
                if job.failure is not None:  # an HTTP error, as the chat route answers it (logged once)
                    raise ApiError.from_exception(job.failure)
                return job.final

            final = await until_disconnect(http, whole())
            text = await asyncio.to_thread(dumps, final)  # a response echoing 20,000 tools is megabytes
            return Response(text, media_type="application/json; charset=utf-8")

        return await serve_model(state, model_field(body), keep_alive_field(body), run, http)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - every failure answers with the error envelope
        return error_answer(e)


async def _count(state: ServerState, store: ResponseStore, http: HttpRequest) -> Response:
    """``POST /v1/responses/input_tokens`` (llama-server's ``handle_count_tokens``): the request is
    read as ``/v1/responses`` reads it (``previous_response_id`` included), planned, and nothing
    runs; a prompt that cannot fit the context is a 400."""
    try:
        body = await read_json(http)
        turn = await asyncio.to_thread(chat_body, {**body, "stream": False}, store, state.args.reasoning_budget,
                                       owner_of(state, http))

        def count(runner: Runner) -> ResponseInputTokens:
            plan = plan_chat(runner, chat_request(runner, turn))
            return ResponseInputTokens(object="response.input_tokens",
                                       input_tokens=plan.input_tokens())

        async def run(runner: Runner) -> Response:
            return json_response((await asyncio.to_thread(count, runner)).wire())

        return await serve_model(state, model_field(body), keep_alive_field(body), run, http)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - every failure answers with the error envelope
        return error_answer(e)


def _query_limit(query) -> int:
    """``limit``: ASCII digits only (``str.isdigit`` also takes ``²`` and other Unicode digits), 1-100."""
    raw = query.get("limit", "20")
    if not (0 < len(raw) <= 3 and raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 100:
        raise _bad(f"Field 'limit': expected an integer from 1 to 100, got {raw[:64]!r}", "limit")
    return int(raw)


def _items_page(items: list[dict], query) -> dict:
    """One page of input items, OpenAI's cursor list: ``order`` (``desc``, the default, or
    ``asc``), ``limit`` (1-100, default 20), ``after`` (an item id; the page starts after it;
    ids are unique in a request, see :func:`check_item_ids`)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad(f"Field 'order': expected 'asc' or 'desc', got {order[:64]!r}", "order")
    limit = _query_limit(query)
    if order == "desc":
        items = items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        start = next((k + 1 for k, it in enumerate(items) if it["id"] == after), -1)
        if start < 0:
            raise _bad(f"Field 'after': no input item with id '{after[:128]}' in this response", "after")
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def _items_page_json(entry, query) -> str:
    """:func:`_items_page` of a stored entry, as JSON text (parsing and writing: a worker thread's job)."""
    return dumps(_items_page(list(entry.input_items), query))


_JSON = "application/json; charset=utf-8"


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id[:128]}' not found.")


#: the path segment of the POST-only ``/v1/responses/input_tokens`` route
_COUNT_ROUTE = "input_tokens"


def _check_not_count_route(response_id: str) -> None:
    """``GET`` / ``DELETE /v1/responses/input_tokens`` name the POST-only count route, not a
    response (ids are ``resp_...``): the server's answer to any method a route does not take
    (llama-server's 404 ``File Not Found``, as ``GET /responses/input_tokens`` and ``GET
    /v1/chat/completions`` answer), not ``Response with id 'input_tokens' not found``."""
    if response_id == _COUNT_ROUTE:
        raise StarletteHTTPException(405, headers={"Allow": "POST"})


def build_router(state: ServerState, store: ResponseStore | None = None) -> APIRouter:
    """The Responses API's routes (create, retrieve, input items, delete), bound to ``state``, with
    their own store of responses (``store``: default a :class:`ResponseStore` with its default
    limits)."""
    r = APIRouter()
    kept = store if store is not None else ResponseStore()

    @r.post("/v1/responses")
    @r.post("/responses")  # llama-server serves it without /v1 too
    async def create(http: HttpRequest) -> Response:
        return await _create(state, kept, http)

    @r.post("/v1/responses/input_tokens")
    @r.post("/responses/input_tokens")
    async def input_tokens(http: HttpRequest) -> Response:
        return await _count(state, kept, http)

    @r.get("/v1/responses/{response_id}")
    async def retrieve(http: HttpRequest) -> Response:
        response_id = http.path_params["response_id"]  # read here: a typed parameter costs FastAPI a model field
        _check_not_count_route(response_id)
        entry = kept.get(response_id, owner_of(state, http))
        if entry is None:
            return error_response(_not_found(response_id))
        if http.query_params.get("stream", "false").lower() != "false":
            return error_response(_bad("Streaming a stored response is not supported: GET it without 'stream'",
                                       "stream"))
        return Response(entry.response_json, media_type=_JSON)  # stored as the JSON text the client got

    @r.get("/v1/responses/{response_id}/input_items")
    async def input_items(http: HttpRequest) -> Response:
        response_id = http.path_params["response_id"]  # read here: a typed parameter costs FastAPI a model field
        entry = kept.get(response_id, owner_of(state, http))
        if entry is None:
            return error_response(_not_found(response_id))
        try:
            text = await asyncio.to_thread(_items_page_json, entry, http.query_params)
        except ApiError as e:
            return error_response(e)
        return Response(text, media_type=_JSON)

    @r.delete("/v1/responses/{response_id}")
    async def delete(http: HttpRequest) -> Response:
        response_id = http.path_params["response_id"]  # read here: a typed parameter costs FastAPI a model field
        _check_not_count_route(response_id)
        if not kept.delete(response_id, owner_of(state, http)):
            return error_response(_not_found(response_id))
        return json_response(DeletedResponse(id=response_id, object="response", deleted=True).wire())

    return r
