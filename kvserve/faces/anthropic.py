"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The face translates only. A Messages request becomes kvserve's
:class:`~kvserve.serving.chat_request.ChatRequest` (:func:`chat_request`), which
:func:`kvserve.serving.chat_plan.plan_chat` turns into the engine requests, with their tools,
tool_choice grammar, reasoning split and thinking budget; the answer comes back from
:func:`kvserve.serving.choices.chat_events` as text, reasoning and tool-call pieces (or the whole
answer) and leaves as Anthropic's message object or its SSE events
(:mod:`kvserve.faces.anthropic_types`).

Request fields:

- ``system``: a string or text blocks -> the system message;
- ``messages``: ``user`` / ``assistant`` turns, content a string or blocks: ``text``;
  ``tool_use`` (assistant) -> ``tool_calls``; ``tool_result`` (user; content a string or text
  blocks; its ``tool_use_id`` must name an earlier ``tool_use``, else 400) -> a ``tool`` message;
  ``thinking`` (assistant) -> the message's ``reasoning_content``, rendered by the chat template
  where it keeps reasoning (Qwen 3 keeps it after the last user query), as llama-server converts
  it; ``redacted_thinking`` is dropped. An ``image`` (in a turn or a ``tool_result``) is
  llama-server's answer for a model without a vision projector: 500 ``image input is not
  supported - hint: ...``; ``document`` blocks are refused (400). An empty ``messages`` list is
  accepted as llama-server accepts it: the prompt is the template's generation prompt (after
  ``system``, when given). A final assistant turn is continued (Anthropic's prefill);
- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``) -> function tools;
  server tools (``web_search_...``, ``bash_...``) are refused with 400 naming their type;
- ``tool_choice``: ``auto`` / ``any`` / ``tool`` (name) / ``none`` -> ``auto`` / ``required`` /
  the named function / ``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``max_tokens`` (required, >= 1, as Anthropic requires) is a cap: the generation stops at
  ``max_tokens`` or when the slot's context is full, whichever comes first (a prompt that does
  not fit the context itself is a 400); ``stop_sequences``; ``temperature`` and ``top_p`` (0..1),
  ``top_k`` (an integer >= 0); ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` -> the thinking
  budget (N must be below ``max_tokens``, as Anthropic checks; Anthropic's minimum of 1024 is
  not enforced: small local models think briefly), ``enabled``/``adaptive``/``between_tools`` set the template's
  ``enable_thinking``, ``disabled`` clears it (``display`` is ignored: thinking is shown);
- ``output_config``: ``format`` ``{"type": "json_schema", "schema"}`` -> structured output (the
  schema constrains the text); ``effort`` -> the template's ``reasoning_effort``. ``temperature``,
  ``top_p`` and ``top_k`` are read although the newest client no longer lists them (send them
  with ``extra_body``);
- ``metadata``, ``service_tier``, ``container``, ``mcp_servers`` and other fields are accepted
  and ignored; of llama-server's extensions ``seed``, ``cache_prompt``, ``id_slot``,
  ``cache_salt``, ``min_p``, ``repeat_penalty`` and Ollama's ``keep_alive`` are passed on.

Headers: ``x-api-key`` (or ``Authorization: Bearer``) under ``--api-key``
(:mod:`kvserve.faces.auth` answers a wrong key with Anthropic's 401 envelope here);
``anthropic-version`` and ``anthropic-beta`` are accepted and ignored.

Answers: ``stop_reason`` ``end_turn`` (end of generation), ``max_tokens``, ``stop_sequence``
(with ``stop_sequence`` the matched string), ``tool_use`` (the answer calls tools),
``model_context_window_exceeded`` (the context filled up before ``max_tokens`` was reached; when
``max_tokens`` is exactly the room the prompt leaves, ``max_tokens``). ``usage``: see
:mod:`kvserve.faces.anthropic_types` (``cache_read_input_tokens`` = the prompt tokens reused
from the prefix cache). An answer with no text, thinking or call holds one empty text block.

Streaming (``stream: true``): ``event: <type>`` + ``data: {json}`` per event, in Anthropic's
order: ``message_start`` (sent once the prompt is processed, with its usage), then per block
``content_block_start``, deltas (``thinking_delta`` + an empty ``signature_delta``,
``text_delta``, or one ``input_json_delta`` holding a whole call's arguments: calls are sent
once they closed and parsed), ``content_block_stop``; one ``ping`` after the first block starts
and every ``--sse-ping-interval`` seconds of silence after ``message_start`` (none before it:
a request waiting for a slot sends nothing until its prompt is processed); ``message_delta`` (stop reason, usage),
``message_stop``. An error before the first event is a plain HTTP error; after it, one
``event: error`` and the stream ends.

Errors, every one in ``{"type": "error", "error": {"type", "message"}}``: 400
invalid_request_error (malformed JSON, bad fields, a prompt over the context; also what other
faces answer 501 for, a feature this server or model lacks), 401 authentication_error, 404
not_found_error (unknown model, unknown route under ``/v1/messages``), 413 request_too_large,
503 overloaded_error (loading, no room: retryable, as the client treats it), 500 api_error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from kvserve.engine.request import InvalidRequestError, RequestOutput
from kvserve.errors import KvserveError
from kvserve.faces import anthropic_types as at
from kvserve.faces.auth import caller
from kvserve.faces.chat_features import check_tool_choice, parse_tools
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response, read_json
from kvserve.faces.models import keep_alive_field, model_field, serve_model
from kvserve.faces.params import get_int, get_str, sampling_fields, slot_view
from kvserve.serving.chat_output import Piece, ReasoningPiece, TextPiece
from kvserve.serving.chat_plan import Plan, plan_chat
from kvserve.serving.chat_request import ChatRequest
from kvserve.serving.choices import chat_events
from kvserve.serving.ids import new_id
from kvserve.structured.spec import schema_spec
from kvserve.faces.sse import (
    ClientDisconnected,
    sse_named,
    sse_response,
    until_disconnect,
)
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServerState

__all__ = ["build_router", "chat_request", "error_envelope"]

log = logging.getLogger("kvserve.server")

#: Bounds on what one request may list (the body itself is bounded by --max-request-bytes).
MAX_MESSAGES = 100_000  # Anthropic's own limit per request
MAX_BLOCKS = 10_000  # content blocks per message
MAX_TOOLS = 512
MAX_STOP_SEQUENCES = 64
MAX_STOP_SEQUENCE_CHARS = 1_000
#: llama-server / Ollama extensions passed on to the chat request as they are
_PASSTHROUGH = ("seed", "cache_prompt", "min_p", "repeat_penalty")  # llama-server's sampling fields, by its names
#: Anthropic's error type for each status kvserve answers
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def _anthropic_id(prefix: str) -> str:
    """Anthropic's ids: ``msg_`` / ``toolu_`` + 24 letters and digits."""
    return new_id(prefix, 24)


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


# ------------------------------------------------------------------------ request -> chat request


def chat_request(body: dict, *, counting: bool = False) -> ChatRequest:
    """A Messages request -> kvserve's chat request (see the module docstring for each field).

    ``max_tokens`` is a cap (``n_predict_is_default``): the engine lowers it to the room the
    prompt leaves in the context instead of refusing the request.

    Args:
        body: the request JSON object.
        counting: a ``count_tokens`` request (no ``max_tokens``; sampling fields ignored).

    Raises:
        ApiError: 400 naming the field as Anthropic does (``messages.0.content.1.type: ...``),
            e.g. ``max_tokens: Field required``.
    """
    max_tokens = 1 if counting else _max_tokens(body)  # checked first: the field clients forget
    req = ChatRequest(_system(body.get("system")) + _messages(body.get("messages")), new_id("chatcmpl-"),
                      model=model_field(body) or "", keep_alive=keep_alive_field(body), messages_may_be_empty=True)
    req.tools = parse_tools(_tools(body.get("tools")))
    req.tool_choice, req.parallel_tool_calls = _tool_choice(body.get("tool_choice"), req.tools)
    req.sampling = {"n_predict": max_tokens}
    if not counting:
        req.sampling = sampling_fields({**_sampling(body), "stop": _stop_sequences(body.get("stop_sequences")) or None},
                                       None) | {"n_predict": max_tokens}
        req.n_predict_is_default = True  # a cap, never refused for the context
        id_slot = get_int(body, "id_slot", -1)
        req.id_slot, req.cache_salt = (-1 if id_slot is None else id_slot), get_str(body, "cache_salt") or None
    req.template.variables, req.reasoning.budget = _thinking(body.get("thinking"), None if counting else max_tokens)
    req.response_format, req.reasoning.effort = _output_config(body.get("output_config"))
    req.owner = caller()
    return req


#: top_k and thinking budgets above this are the same as this (no vocabulary or generation is
#: that large); passed on so, they stay within the int64 the chat parser reads
_INT_CAP = 2**31 - 1


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{where}: Input should be a valid number, got {_kind(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(f"{where}: Input should be a finite number")
    return v


def _sampling(body: dict) -> dict[str, Any]:
    """``temperature`` and ``top_p`` in 0..1, ``top_k`` an integer >= 0, checked as Anthropic
    checks them (400 naming the field), and llama-server's sampling fields (:data:`_PASSTHROUGH`)
    as sent: the values :func:`kvserve.faces.params.sampling_fields` reads."""
    chat: dict[str, Any] = {key: body[key] for key in _PASSTHROUGH if body.get(key) is not None}
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is None:
            continue
        v = _number(v, key)
        if v < 0:
            raise _bad(f"{key}: Input should be greater than or equal to 0")
        if v > 1:
            raise _bad(f"{key}: Input should be less than or equal to 1")
        chat[key] = v
    k = body.get("top_k")
    if k is not None:
        k = _number(k, "top_k")
        if isinstance(k, float):
            if not k.is_integer():
                raise _bad("top_k: Input should be a valid integer, got a number with a fractional part")
            k = int(k)
        if k < 0:
            raise _bad("top_k: Input should be greater than or equal to 0")
        chat["top_k"] = min(k, _INT_CAP)
    return chat


def _output_config(oc: Any) -> tuple[Any, str | None]:
    """``output_config`` -> ``(constraint, effort)``: ``format`` (``json_schema``) -> a JSON-schema
    constraint (its errors name ``response_format.json_schema.schema``, as before this face had its
    own request type); ``effort`` -> the template's ``reasoning_effort``."""
    spec = effort = None
    if oc is None:
        return None, None
    if not isinstance(oc, dict):
        raise _bad(f"output_config: Input should be an object, got {_kind(oc)}")
    fmt = oc.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise _bad("output_config.format.type: Input should be 'json_schema'")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("output_config.format.schema: Field required" if schema is None else
                       f"output_config.format.schema: Input should be an object, got {_kind(schema)}")
        spec = schema_spec(schema, "response_format.json_schema.schema")
    effort = oc.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise _bad("output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'")
    return spec, effort


def _max_tokens(body: dict) -> int:
    v = body.get("max_tokens")
    if v is None:
        raise _bad("max_tokens: Field required")
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"max_tokens: Input should be a valid integer, got {_kind(v)}")
    if v < 1:
        raise _bad("max_tokens: Input should be greater than or equal to 1")
    return v


def _text_of(blocks: Any, where: str, *, allow_string: bool = True) -> str:
    """A string, or a list of text blocks joined with newlines."""
    if isinstance(blocks, str) and allow_string:
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where}: Input should be a string or a list of text blocks, got {_kind(blocks)}")
    if len(blocks) > MAX_BLOCKS:
        raise _bad(f"{where}: at most {MAX_BLOCKS} blocks")
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else None
            raise _bad(f"{where}.{j}: only text blocks are supported here, got "
                       f"{repr(kind)[:64] if isinstance(kind, str) else _kind(b)}")
        parts.append(_str_field(b, "text", f"{where}.{j}"))
    return "\n".join(parts)


def _str_field(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise _bad(f"{where}.{key}: Field required" if v is None else
                   f"{where}.{key}: Input should be a valid string, got {_kind(v)}")
    return v


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = _text_of(system, "system")
    return [{"role": "system", "content": text}]


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise _bad("messages: Field required")
    if not isinstance(messages, list):
        raise _bad(f"messages: Input should be a valid list, got {_kind(messages)}")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"messages: at most {MAX_MESSAGES} messages")
    out: list[dict] = []
    tool_ids: set[str] = set()  # ids of the tool_use blocks so far: a tool_result must answer one
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise _bad(f"{where}: Input should be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            if not content and not (role == "assistant" and i == len(messages) - 1):
                raise _bad(f"{where}: all messages must have non-empty content except for the optional final "
                           f"assistant message")
            if len(content) > MAX_BLOCKS:
                raise _bad(f"{where}.content: at most {MAX_BLOCKS} blocks")
            if role == "user":
                out += _user_blocks(content, where, tool_ids)
            else:
                msg = _assistant_blocks(content, where)
                tool_ids.update(c["id"] for c in msg[0].get("tool_calls", ()))
                out += msg
        else:
            raise _bad(f"{where}.content: Field required" if content is None else
                       f"{where}.content: Input should be a string or a list of content blocks, got {_kind(content)}")
    return out


def _block_type(b: Any, where: str) -> str:
    if not isinstance(b, dict):
        raise _bad(f"{where}: Input should be a content block object, got {_kind(b)}")
    t = b.get("type")
    if not isinstance(t, str):
        raise _bad(f"{where}.type: Field required")
    return t


#: llama-server's answer to an image for a model without a vision projector (a 500, its status)
NO_IMAGE_INPUT = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"


def _unsupported(t: str, where: str) -> ApiError:
    """The error for a block of type ``t`` that this place does not take: an ``image`` is
    llama-server's 500 :data:`NO_IMAGE_INPUT` (kvserve's models are text-only), a ``document``
    400 naming the block, any other type 400."""
    if t == "image":
        return ApiError(500, NO_IMAGE_INPUT)
    if t == "document":
        return _bad(f"{where}: {t} blocks are not supported by this server (text-only models)")
    return _bad(f"{where}: content block type {t[:64]!r} is not supported here")


def _user_blocks(blocks: list, where: str, tool_ids: set[str]) -> list[dict]:
    """A user turn's blocks -> user messages (text, in order) and tool messages (tool_result).
    A tool_result whose ``tool_use_id`` is none of ``tool_ids`` (the earlier tool_use blocks) is
    a 400, as Anthropic answers it."""
    out: list[dict] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, b in enumerate(blocks):
        w = f"{where}.content.{j}"
        t = _block_type(b, w)
        if t == "text":
            texts.append(_str_field(b, "text", w))
        elif t == "tool_result":
            flush()
            tid = _str_field(b, "tool_use_id", w)
            c = b.get("content")
            text = "" if c is None else _result_text(c, f"{w}.content")
            if tid not in tool_ids:  # checked after the block's shape, as Anthropic orders its errors
                raise _bad(f"{w}: unexpected `tool_use_id` found in `tool_result` blocks: {tid[:128]}. Each "
                           f"`tool_result` block must have a corresponding `tool_use` block in an earlier message.")
            out.append({"role": "tool", "tool_call_id": tid, "content": text})
        else:
            raise _unsupported(t, w)
    flush()
    return out


def _result_text(content: Any, where: str) -> str:
    """A ``tool_result``'s content (a string or text blocks) as text; an image block in it is
    llama-server's 500 (:data:`NO_IMAGE_INPUT`), other blocks 400."""
    if isinstance(content, list):
        for j, b in enumerate(content[:MAX_BLOCKS]):
            if isinstance(b, dict) and b.get("type") == "image":
                raise _unsupported("image", f"{where}.{j}")
    return _text_of(content, where)


def _assistant_blocks(blocks: list, where: str) -> list[dict]:
    """An assistant turn's blocks -> one assistant message: text joined, ``tool_use`` as
    ``tool_calls``, ``thinking`` as ``reasoning_content`` (the thinking texts joined with
    newlines), which the chat template renders in its reasoning markup where it keeps reasoning,
    as llama-server converts them; ``redacted_thinking`` (no text) is dropped."""
    texts: list[str] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, b in enumerate(blocks):
        w = f"{where}.content.{j}"
        t = _block_type(b, w)
        if t == "text":
            texts.append(_str_field(b, "text", w))
        elif t == "tool_use":
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{w}.input: Input should be an object, got {_kind(args)}")
            calls.append({"id": _str_field(b, "id", w), "type": "function",
                          "function": {"name": _str_field(b, "name", w), "arguments": args}})
        elif t == "thinking":
            thoughts.append(_str_field(b, "thinking", w))
        elif t != "redacted_thinking":
            raise _unsupported(t, w)
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if any(thoughts):
        msg["reasoning_content"] = "\n".join(thoughts)
    return [msg]


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(f"tools: Input should be a valid list, got {_kind(tools)}")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools: at most {MAX_TOOLS} tools")
    out = []
    for j, t in enumerate(tools):
        w = f"tools.{j}"
        if not isinstance(t, dict):
            raise _bad(f"{w}: Input should be an object, got {_kind(t)}")
        typ = t.get("type")
        if typ not in (None, "custom"):
            shown = repr(typ)[:80] if isinstance(typ, str) else _kind(typ)
            raise _bad(f"{w}: tool type {shown} is not supported by this server (only custom tools with an "
                       f"input_schema)")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{w}.input_schema: Field required" if schema is None else
                       f"{w}.input_schema: Input should be an object, got {_kind(schema)}")
        fn: dict[str, Any] = {"name": _str_field(t, "name", w)}
        if t.get("description") is not None:
            fn["description"] = _str_field(t, "description", w)
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out or None


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(tc: Any, tools: list[dict] | None) -> tuple[str | dict, bool]:
    """``tool_choice`` -> ``(choice, parallel)``: ``auto`` / ``any`` / ``tool`` (a name in
    ``tools``) / ``none`` -> ``auto`` / ``required`` / ``{"name": ...}`` / ``none`` (default: ``auto``
    with tools, else ``none``); ``disable_parallel_tool_use`` -> not parallel."""
    if tc is None:
        return ("auto" if tools else "none"), True
    if not isinstance(tc, dict):
        raise _bad(f"tool_choice: Input should be an object, got {_kind(tc)}")
    typ = tc.get("type")
    if typ == "tool":
        name = _str_field(tc, "name", "tool_choice")
        if all(t["function"]["name"] != name for t in tools or []):
            raise _bad(f"tool_choice.name: Tool '{name}' not found in tools")
        choice: str | dict = {"name": name}
    elif isinstance(typ, str) and typ in _TOOL_CHOICES:  # any JSON value may come: a dict is no key
        choice = _TOOL_CHOICES[typ]
    else:
        raise _bad("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    off = tc.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise _bad(f"tool_choice.disable_parallel_tool_use: Input should be a valid boolean, got {_kind(off)}")
    # auto / any without tools: 400 in the chat route's words, as this face always answered
    return check_tool_choice(choice, tools), off is not True


def _stop_sequences(v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad(f"stop_sequences: Input should be a valid list, got {_kind(v)}")
    if len(v) > MAX_STOP_SEQUENCES:
        raise _bad(f"stop_sequences: at most {MAX_STOP_SEQUENCES} sequences")
    for j, s in enumerate(v):
        if not isinstance(s, str) or not s:
            raise _bad(f"stop_sequences.{j}: Input should be a non-empty string")
        if len(s) > MAX_STOP_SEQUENCE_CHARS:
            raise _bad(f"stop_sequences.{j}: at most {MAX_STOP_SEQUENCE_CHARS} characters")
    return list(v)


def _thinking(th: Any, max_tokens: int | None) -> tuple[dict, int | None]:
    """``thinking`` -> ``(template variables, thinking budget or None)``."""
    if th is None:
        return {}, None
    if not isinstance(th, dict):
        raise _bad(f"thinking: Input should be an object, got {_kind(th)}")
    typ = th.get("type")
    if typ == "disabled":
        return {"enable_thinking": False}, None
    if typ not in ("enabled", "adaptive", "between_tools"):
        raise _bad("thinking.type: Input should be 'enabled', 'adaptive', 'between_tools' or 'disabled'")
    if typ != "enabled":
        return {"enable_thinking": True}, None
    budget = th.get("budget_tokens")
    if budget is None:
        raise _bad("thinking.enabled.budget_tokens: Field required")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise _bad("thinking.enabled.budget_tokens: Input should be an integer >= 0")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("`max_tokens` must be greater than `thinking.budget_tokens`")
    return {"enable_thinking": True}, min(budget, _INT_CAP)  # max_tokens is a cap: any budget below it is valid


# ------------------------------------------------------------------------ plan and output


class _Plan:
    """One Messages request: the chat plan, the stop sequences asked for, streaming or not,
    and whether the context (not ``max_tokens``) bounds the generation (``by_context``)."""

    def __init__(self, plan: Plan, stops: list[str], stream: bool, by_context: bool = False):
        self.plan = plan
        self.stops = stops
        self.stream = stream
        self.by_context = by_context
        self.id = _anthropic_id("msg_")


def _messages_plan(runner: Runner, body: dict) -> _Plan:
    """Parse and plan a Messages request (raises ApiError 400 on bad fields).

    ``max_tokens`` is a cap, as Anthropic's clients use it (Claude-style agents send 32000-64000
    on every request): the generation stops at ``min(max_tokens, n_ctx_slot - prompt tokens)``,
    so a large ``max_tokens`` is never refused for the context; a prompt that does not itself
    fit the slot's context is still a 400. (The OpenAI face refuses prompt + max_tokens over
    the context, as llama-server does.)
    """
    req = chat_request(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"stream: Input should be a valid boolean, got {_kind(stream)}")
    cap = req.sampling["n_predict"]
    plan = plan_chat(runner, req)  # the engine lowered the cap to the room each prompt leaves
    n_ctx = runner.engine.n_ctx_slot
    # free >= 1: the engine refused a prompt that fills the context
    by_context = any(cap > n_ctx - len(r.prompt_token_ids) for r in plan.requests)
    return _Plan(plan, list(req.sampling.get("stop", ())), stream, by_context)


def _count_tokens(runner: Runner, body: dict) -> at.CountTokens:
    """The token count of the prompt the same request to /v1/messages would run (the same
    rendering and tokenization). A prompt that cannot fit the model's context is a 400."""
    plan = plan_chat(runner, chat_request(body, counting=True))
    return at.CountTokens(input_tokens=plan.input_tokens())


def _usage(out: RequestOutput, output_tokens: int | None = None) -> at.Usage:
    cached = out.num_cached_tokens
    return at.Usage(input_tokens=out.num_prompt_tokens - cached, cache_creation_input_tokens=0,
                    cache_read_input_tokens=cached,
                    output_tokens=out.num_output_tokens if output_tokens is None else output_tokens)


def _stop(out: RequestOutput, calls: bool, stops: list[str], by_context: bool = False) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished output. A length stop is
    ``model_context_window_exceeded`` only when the context was smaller than ``max_tokens``
    asked for (``by_context``, see :func:`_messages_plan`); when ``max_tokens`` is exactly the
    room left, it is ``max_tokens`` (the limit the client set ended it)."""
    if calls:
        return "tool_use", None
    if out.stop_type == "word" and out.stopping_word in stops:
        return "stop_sequence", out.stopping_word
    if out.finish_reason == "length":
        return ("model_context_window_exceeded", None) if by_context and out.truncated else ("max_tokens", None)
    return "end_turn", None


def _tool_input(arguments: str) -> dict:
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


async def _complete(runner: Runner, mp: _Plan) -> at.Message:
    """Run a non-streaming request to the end and build the message object (the serving
    layer's whole answer, :func:`chat_events` with ``whole``)."""
    plan = mp.plan
    last = None
    async for ev in chat_events(runner, plan, slot_view(plan.grammar), whole=True):
        if ev.answer is not None:
            last = ev
    assert last is not None
    ans = last.answer
    blocks: list = []
    if ans.reasoning:
        blocks.append(at.ThinkingBlock(type="thinking", thinking=ans.reasoning, signature=""))
    if ans.text:
        blocks.append(at.TextBlock(type="text", text=ans.text))
    for c in ans.tool_calls:
        blocks.append(at.ToolUseBlock(type="tool_use", id=_anthropic_id("toolu_"), name=c.name,
                                      input=_tool_input(c.arguments)))
    if not blocks:
        blocks.append(at.TextBlock(type="text", text=""))
    reason, seq = _stop(last.output, bool(ans.tool_calls), mp.stops, mp.by_context)
    return at.Message(id=mp.id, type="message", role="assistant", model=plan.model, content=blocks,
                      stop_reason=reason, stop_sequence=seq, usage=_usage(last.output))


class _Blocks:
    """Turns the answer's pieces into content block events: a block opens when the kind of
    output changes (thinking, text, a tool call) and closes when the next one opens."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None
        self.pinged = False

    def _start(self, kind: str, block) -> list[dict]:
        evs = self.close()
        self.index += 1
        self.open = kind
        evs.append(at.ContentBlockStart(type="content_block_start", index=self.index, content_block=block).wire())
        if not self.pinged:
            self.pinged = True
            evs.append(at.Ping(type="ping").wire())
        return evs

    def _delta(self, delta) -> dict:
        return at.ContentBlockDelta(type="content_block_delta", index=self.index, delta=delta).wire()

    def feed(self, piece: Piece) -> list[dict]:
        """Events for one piece (text, reasoning or a whole tool call)."""
        evs: list[dict] = []
        if isinstance(piece, ReasoningPiece):
            if piece.text:
                if self.open != "thinking":
                    evs += self._start("thinking", at.ThinkingBlock(type="thinking", thinking="", signature=""))
                evs.append(self._delta(at.ThinkingDelta(type="thinking_delta", thinking=piece.text)))
        elif isinstance(piece, TextPiece):
            if piece.text:
                if self.open != "text":
                    evs += self._start("text", at.TextBlock(type="text", text=""))
                evs.append(self._delta(at.TextDelta(type="text_delta", text=piece.text)))
        else:
            evs += self._start("tool_use", at.ToolUseBlock(type="tool_use", id=_anthropic_id("toolu_"),
                                                           name=piece.name, input={}))
            if piece.arguments:
                evs.append(self._delta(at.InputJsonDelta(type="input_json_delta", partial_json=piece.arguments)))
        return evs

    def close(self) -> list[dict]:
        """Events that close the open block (a thinking block gets its empty signature first)."""
        if self.open is None:
            return []
        evs = []
        if self.open == "thinking":
            evs.append(self._delta(at.SignatureDelta(type="signature_delta", signature="")))
        evs.append(at.ContentBlockStop(type="content_block_stop", index=self.index).wire())
        self.open = None
        return evs

    def finish(self) -> list[dict]:
        """Close the last block; with no block at all, one empty text block."""
        if self.index < 0:
            return self._start("text", at.TextBlock(type="text", text="")) + self.close()
        return self.close()


async def _stream_events(runner: Runner, mp: _Plan) -> AsyncIterator[dict]:
    """The stream's events as JSON objects (see the module docstring), ``message_start`` once
    the first output arrived (the prompt is processed: its usage is known); the content blocks
    from the serving layer's answer pieces (:func:`chat_events`)."""
    plan = mp.plan
    blocks = _Blocks()
    last, started = None, False
    async for ev in chat_events(runner, plan, slot_view(plan.grammar)):
        if not started:
            started = True
            start = at.Message(id=mp.id, type="message", role="assistant", model=plan.model, content=[],
                               stop_reason=None, stop_sequence=None, usage=_usage(ev.output, 0))
            yield at.MessageStart(type="message_start", message=start).wire()
        for p in ev.pieces:
            for e in blocks.feed(p):
                yield e
        if ev.output.finished:
            last = ev
    assert last is not None
    for e in blocks.finish():
        yield e
    reason, seq = _stop(last.output, last.called_tools, mp.stops, mp.by_context)
    yield at.MessageDelta(type="message_delta", delta=at.MessageDeltaBody(stop_reason=reason, stop_sequence=seq),
                          usage=_usage(last.output)).wire()
    yield at.MessageStop(type="message_stop").wire()


# ------------------------------------------------------------------------ SSE and errors


def _status_and_type(e: BaseException) -> tuple[int, str, str]:
    api = ApiError.from_exception(e)
    status = 400 if api.status == 501 else api.status  # Anthropic has no 501: a feature this model lacks
    etype = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, etype, api.message


def _log_server_fault(e: BaseException) -> None:
    client = isinstance(e, (ApiError, InvalidRequestError)) or (isinstance(e, KvserveError) and e.kind != "server")
    if not client or (isinstance(e, ApiError) and e.status >= 500):
        log.error("request failed: %s", ApiError.from_exception(e).message,
                  exc_info=None if isinstance(e, ApiError) else e, extra={"func": "messages"})


def error_envelope(e: BaseException) -> tuple[int, dict]:
    """``(status, {"type": "error", "error": {"type", "message"}})`` for any exception, with
    Anthropic's error type for the status (see the module docstring). Server faults are logged."""
    _log_server_fault(e)
    status, etype, message = _status_and_type(e)
    return status, at.AnthropicError(type="error", error=at.ErrorDetail(type=etype, message=message)).wire()


def _error_response(e: BaseException) -> Response:
    status, body = error_envelope(e)
    return json_response(body, status)


_PING = sse_named({"type": "ping"})


async def _sse(events: AsyncIterator[dict], ping_interval: float) -> StreamingResponse:
    """Stream ``events`` as Anthropic's SSE (:func:`~kvserve.faces.sse.sse_response`, starting
    once the first event exists: an error before it is raised, for a plain HTTP error):
    ``event: <type>`` lines, ``event: ping`` while idle for ``ping_interval`` seconds (<= 0:
    never) once ``message_start`` was sent, never before it (a request queued behind busy slots
    waits silently); an error after the start is one ``event: error``."""
    return await sse_response(events, ping_interval=ping_interval, done=False, encode=sse_named, ping=_PING,
                        ping_before_first=False, error_event=lambda e: error_envelope(e)[1],
                        headers={"X-Accel-Buffering": "no"})


# ------------------------------------------------------------------------ routes


async def _serve(state: ServerState, http: HttpRequest, counting: bool) -> Response:
    try:
        body = await read_json(http)

        async def run(runner: Runner) -> Response:
            if counting:
                return json_response((await asyncio.to_thread(_count_tokens, runner, body)).wire())
            # tokenizing, template rendering and grammar compiles are CPU work: off the event loop
            mp = await asyncio.to_thread(_messages_plan, runner, body)
            if mp.stream:
                return await _sse(_stream_events(runner, mp), state.args.sse_ping_interval)
            return json_response((await until_disconnect(http, _complete(runner, mp))).wire())

        return await serve_model(state, model_field(body), keep_alive_field(body), run, http)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - every failure answers with Anthropic's envelope
        return _error_response(e)


def build_router(state: ServerState) -> APIRouter:
    """The Messages API's routes, bound to ``state``."""
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(http: HttpRequest) -> Response:
        return await _serve(state, http, counting=False)

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(http: HttpRequest) -> Response:
        return await _serve(state, http, counting=True)

    @r.api_route("/v1/messages", methods=["GET", "PUT", "PATCH", "DELETE"])
    @r.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def not_found(http: HttpRequest) -> Response:
        return _error_response(ApiError(404, f"{http.method} {http.url.path[:256]} not found"))

    return r
