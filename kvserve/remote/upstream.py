"""Talking to a remote model's upstream: kvserve's chat request -> the upstream's request body
(:func:`openai_body`, :func:`ollama_body`), and the upstream's stream -> kvserve's typed answer
pieces (:class:`OpenAIStream`, :class:`OllamaStream`: :class:`~kvserve.serving.chat_output.TextPiece`,
:class:`~kvserve.serving.chat_output.ReasoningPiece`, :class:`~kvserve.serving.chat_output.ToolCallPiece`),
so every face renders a remote answer in its own dialect.

Only what the request set is forwarded (its sampling fields, tools, response format, reasoning
effort, template variables): the upstream's own defaults apply to the rest, as they would for a
client talking to it directly.

Bounds (:class:`Limits`): one event (an SSE ``data:`` line or an NDJSON line) at most
:data:`MAX_EVENT_BYTES`, a whole answer at most :data:`MAX_STREAM_BYTES`, an error body read up to
:data:`MAX_ERROR_BYTES`; beyond them the request ends with an error and the connection is closed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import SEED_RANDOM
from kvserve.errors import InvalidInputError, NotSupportedError
from kvserve.serving.chat_output import Piece, ReasoningPiece, TextPiece, ToolCallPiece

__all__ = ["MAX_ERROR_BYTES", "MAX_EVENT_BYTES", "MAX_STREAM_BYTES", "OllamaStream", "OpenAIStream",
           "UpstreamProtocolError", "error_message", "ollama_body", "openai_body"]

MAX_EVENT_BYTES = 1 << 20
MAX_STREAM_BYTES = 64 << 20
MAX_ERROR_BYTES = 4096

#: kvserve sampling field -> OpenAI chat-completions field (what vLLM and llama-server read)
_OPENAI_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "repeat_penalty": "repetition_penalty", "typical_p": "typical_p", "min_tokens": "min_tokens",
                    "ignore_eos": "ignore_eos"}
#: kvserve sampling field -> Ollama ``options`` key
_OLLAMA_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "typical_p": "typical_p"}


class UpstreamProtocolError(Exception):
    """The upstream sent something that is not its dialect's stream (or over the bounds)."""


def _refuse_unforwardable(req, name: str) -> None:
    if req.n != 1:
        raise NotSupportedError(f"remote model '{name}': n > 1 is not forwarded (ask {req.n} times)")
    if req.logprobs is not None or req.prompt_logprobs is not None:
        raise NotSupportedError(f"remote model '{name}': logprobs are not forwarded")
    if req.sampling.get("logit_bias"):
        raise NotSupportedError(f"remote model '{name}': logit_bias (token ids of kvserve's tokenizer) "
                                "is not forwarded")


def _response_format_openai(spec) -> dict[str, Any]:
    """A ConstraintSpec as the OpenAI body's fields (``response_format``; vLLM's ``guided_*``,
    llama-server's ``grammar`` for what OpenAI has no field for)."""
    if spec is None:
        return {}
    if spec.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if spec.kind == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "response", "schema": json.loads(spec.value)}}}
    if spec.kind == "grammar":
        return {"grammar": spec.value}
    if spec.kind == "regex":
        return {"guided_regex": spec.value}
    if spec.kind == "choice":
        return {"guided_choice": json.loads(spec.value)}
    return {}


def _openai_messages(messages: list) -> list:
    """The messages as OpenAI's wire wants them: a tool call's ``arguments`` as JSON text (the
    Ollama face gives an object), with ``type`` and an ``id``; a tool result without
    ``tool_call_id`` answers the earliest call not answered yet. Other messages pass as they are."""
    out, open_ids, k = [], [], 0
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("tool_calls"):
            m = dict(m)
            calls = []
            for c in m["tool_calls"]:
                if not isinstance(c, dict):
                    continue
                fn = dict(c.get("function") or {})
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments") or {}, ensure_ascii=False)
                cid = c.get("id") or f"call_{k}"
                k += 1
                open_ids.append(cid)
                calls.append({**c, "id": cid, "type": "function", "function": fn})
            m["tool_calls"] = calls
        elif m.get("role") == "tool":
            if not m.get("tool_call_id") and open_ids:
                m = {**m, "tool_call_id": open_ids[0]}
            if m.get("tool_call_id") in open_ids:
                open_ids.remove(m["tool_call_id"])
        out.append(m)
    return out


def openai_body(req, model: str, name: str) -> dict[str, Any]:
    """``req`` (a :class:`~kvserve.serving.chat_request.ChatRequest`) as an OpenAI
    chat-completions streaming body for ``model``.

    Raises:
        NotSupportedError: what cannot be forwarded (``n`` > 1, logprobs, token-id logit bias).
    """
    _refuse_unforwardable(req, name)
    body: dict[str, Any] = {"model": model, "messages": _openai_messages(req.messages), "stream": True,
                            "stream_options": {"include_usage": True}}
    s = req.sampling
    for k, v in _OPENAI_SAMPLING.items():
        if k in s:
            body[v] = s[k]
    if s.get("n_predict", -1) is not None and s.get("n_predict", -1) > 0:
        body["max_tokens"] = s["n_predict"]
    if s.get("seed", SEED_RANDOM) != SEED_RANDOM:
        body["seed"] = s["seed"]
    if s.get("stop"):
        body["stop"] = list(s["stop"])
    if req.tools:
        body["tools"] = req.tools
        body["tool_choice"] = req.tool_choice
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    body.update(_response_format_openai(req.response_format))
    if req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    if req.template.variables:
        body["chat_template_kwargs"] = dict(req.template.variables)
    return body


def _ollama_content(content: Any) -> tuple[str, list[str]]:
    """OpenAI message content (a string or parts) -> Ollama's ``(content, images)`` (images as
    the base64 of ``data:`` URLs; a remote image URL cannot be sent: 400)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, images = [], []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
            if not url.startswith("data:") or "," not in url:
                raise InvalidInputError("an image for an Ollama upstream must be a data: URL")
            images.append(url.split(",", 1)[1])
    return "".join(texts), images


def _ollama_message(m: dict, names: dict[str, str]) -> dict:
    out: dict[str, Any] = {"role": m.get("role", "user")}
    out["content"], images = _ollama_content(m.get("content"))
    if images:
        out["images"] = images
    if m.get("reasoning_content") or m.get("reasoning") or m.get("thinking"):
        out["thinking"] = m.get("reasoning_content") or m.get("reasoning") or m.get("thinking")
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = {}
        if c.get("id"):
            names[c["id"]] = fn.get("name", "")
        calls.append({"function": {"name": fn.get("name", ""), "arguments": args or {}}})
    if calls:
        out["tool_calls"] = calls
    if out["role"] == "tool":
        name = m.get("name") or names.get(m.get("tool_call_id") or "", "")
        if name:
            out["tool_name"] = name
    return out


def ollama_body(req, model: str, name: str) -> dict[str, Any]:
    """``req`` as an Ollama ``/api/chat`` streaming body for ``model``.

    Raises:
        NotSupportedError: what cannot be forwarded (``n`` > 1, logprobs, a grammar, a regex).
    """
    _refuse_unforwardable(req, name)
    names: dict[str, str] = {}
    body: dict[str, Any] = {"model": model, "messages": [_ollama_message(m, names) for m in req.messages
                                                         if isinstance(m, dict)], "stream": True}
    opts: dict[str, Any] = {}
    s = req.sampling
    for k, v in _OLLAMA_SAMPLING.items():
        if k in s:
            opts[v] = s[k]
    if s.get("n_predict", -1) > 0:
        opts["num_predict"] = s["n_predict"]
    if s.get("seed", SEED_RANDOM) != SEED_RANDOM:
        opts["seed"] = s["seed"]
    if s.get("stop"):
        opts["stop"] = list(s["stop"])
    if opts:
        body["options"] = opts
    if req.tools and req.tool_choice != "none":
        body["tools"] = req.tools
    spec = req.response_format
    if spec is not None:
        if spec.kind == "json_object":
            body["format"] = "json"
        elif spec.kind == "json_schema":
            body["format"] = json.loads(spec.value)
        else:
            raise NotSupportedError(f"remote model '{name}': a {spec.kind} constraint cannot be forwarded to an "
                                    "Ollama upstream (it takes a JSON schema or \"json\")")
    if req.reasoning.effort:
        body["think"] = req.reasoning.effort
    elif isinstance(req.template.variables.get("enable_thinking"), bool):
        body["think"] = req.template.variables["enable_thinking"]
    return body


def error_message(status: int, body: bytes) -> str:
    """The upstream's error text from (the first :data:`MAX_ERROR_BYTES` of) an error body:
    OpenAI's ``{"error": {"message"}}``, Ollama's ``{"error": "..."}``, ``{"detail": ...}``, or the
    text itself (one line, at most 500 characters)."""
    raw = body[:MAX_ERROR_BYTES]
    text = raw.decode("utf-8", "replace")
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("detail", doc.get("message")))
        if isinstance(err, dict):
            err = err.get("message") or err.get("type")
        if isinstance(err, str) and err:
            text = err
    text = " ".join(text.split())
    return (text[:500] + "...") if len(text) > 500 else (text or f"status {status}")


@dataclass
class Final:
    """How the upstream's answer ended.

    Attributes:
        finish_reason: ``stop`` / ``length`` / ``tool_calls`` as the upstream said (None: not said).
        prompt_tokens, completion_tokens, cached_tokens: the upstream's usage (None: not given).
        reasoning_tokens: the upstream's count of thinking tokens (None: not given).
    """

    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    reasoning_tokens: int | None = None


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: str = ""


class OpenAIStream:
    """An OpenAI chat-completions SSE stream -> pieces: feed each ``data:`` payload (text) to
    :meth:`feed`; :meth:`finish` returns the calls still open. Tool-call deltas are joined per
    ``index`` and sent as one whole :class:`ToolCallPiece` once the next call starts or the
    stream ends (kvserve's pieces carry whole calls). :attr:`final` holds the finish and usage.
    :attr:`chunks` counts content chunks (about one token each, for the max-tokens bound).

    Raises (from :meth:`feed`):
        UpstreamProtocolError: a payload that is not JSON; UpstreamError-like texts come back as
            :attr:`error` (an error object inside the stream).
    """

    def __init__(self):
        self.final = Final()
        self.chunks = 0
        self.error: str | None = None
        self._calls: dict[int, _Call] = {}
        self._sent: set[int] = set()
        self._order: list[int] = []

    def feed(self, data: str) -> list[Piece]:
        if data.strip() == "[DONE]":
            return []
        try:
            doc = json.loads(data)
        except ValueError:
            raise UpstreamProtocolError("the upstream sent an event that is not JSON") from None
        if not isinstance(doc, dict):
            raise UpstreamProtocolError("the upstream sent an event that is not a JSON object")
        if doc.get("error") is not None:
            self.error = error_message(500, json.dumps(doc).encode())
            return []
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        out: list[Piece] = []
        for ch in doc.get("choices") or []:
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            d = ch.get("delta") or {}
            r = d.get("reasoning_content") or d.get("reasoning")
            if isinstance(r, str) and r:
                out.append(ReasoningPiece(r))
                self.chunks += 1
            c = d.get("content")
            if isinstance(c, str) and c:
                out.append(TextPiece(c))
                self.chunks += 1
            for tc in d.get("tool_calls") or []:
                out += self._call_delta(tc)
            if ch.get("finish_reason"):
                self.final.finish_reason = ch["finish_reason"]
        return out

    def _usage(self, u: dict) -> None:
        f = self.final
        if isinstance(u.get("prompt_tokens"), int):
            f.prompt_tokens = u["prompt_tokens"]
        if isinstance(u.get("completion_tokens"), int):
            f.completion_tokens = u["completion_tokens"]
        det = u.get("prompt_tokens_details")
        if isinstance(det, dict) and isinstance(det.get("cached_tokens"), int):
            f.cached_tokens = det["cached_tokens"]
        cdet = u.get("completion_tokens_details")
        if isinstance(cdet, dict) and isinstance(cdet.get("reasoning_tokens"), int):
            f.reasoning_tokens = cdet["reasoning_tokens"]

    def _call_delta(self, tc: Any) -> list[Piece]:
        if not isinstance(tc, dict):
            return []
        i = tc.get("index", 0) if isinstance(tc.get("index", 0), int) else 0
        out: list[Piece] = []
        if i not in self._calls:
            out = self._close_open()  # a new call: the earlier ones are whole
            self._calls[i] = _Call()
            self._order.append(i)
        call = self._calls[i]
        if tc.get("id"):
            call.id = tc["id"]
        fn = tc.get("function") or {}
        if isinstance(fn.get("name"), str):
            call.name += fn["name"] if call.name != fn["name"] else ""
        if isinstance(fn.get("arguments"), str):
            call.arguments += fn["arguments"]
            self.chunks += 1
        return out

    def _close_open(self) -> list[Piece]:
        out: list[Piece] = []
        for k, i in enumerate(self._order):
            if i in self._sent:
                continue
            self._sent.add(i)
            c = self._calls[i]
            out.append(ToolCallPiece(k, c.id or f"call_{k}", c.name, c.arguments or "{}"))
        return out

    def finish(self) -> list[Piece]:
        return self._close_open()

    @property
    def called_tools(self) -> bool:
        return bool(self._order)


class OllamaStream:
    """An Ollama ``/api/chat`` NDJSON stream -> pieces (feed each line's text). Ollama sends whole
    tool calls (arguments as an object): each becomes a :class:`ToolCallPiece` at once."""

    def __init__(self):
        self.final = Final()
        self.chunks = 0
        self.error: str | None = None
        self._n_calls = 0

    def feed(self, line: str) -> list[Piece]:
        if not line.strip():
            return []
        try:
            doc = json.loads(line)
        except ValueError:
            raise UpstreamProtocolError("the upstream sent a line that is not JSON") from None
        if not isinstance(doc, dict):
            raise UpstreamProtocolError("the upstream sent a line that is not a JSON object")
        if doc.get("error") is not None:
            self.error = error_message(500, json.dumps(doc).encode())
            return []
        out: list[Piece] = []
        msg = doc.get("message") or {}
        if isinstance(msg, dict):
            if isinstance(msg.get("thinking"), str) and msg["thinking"]:
                out.append(ReasoningPiece(msg["thinking"]))
                self.chunks += 1
            if isinstance(msg.get("content"), str) and msg["content"]:
                out.append(TextPiece(msg["content"]))
                self.chunks += 1
            for c in msg.get("tool_calls") or []:
                fn = (c or {}).get("function") or {}
                args = fn.get("arguments")
                text = args if isinstance(args, str) else json.dumps(args if args is not None else {},
                                                                      ensure_ascii=False)
                out.append(ToolCallPiece(self._n_calls, c.get("id") or f"call_{self._n_calls}",
                                         str(fn.get("name", "")), text))
                self._n_calls += 1
        if doc.get("done"):
            f = self.final
            f.finish_reason = {"stop": "stop", "length": "length"}.get(doc.get("done_reason") or "stop", "stop")
            if isinstance(doc.get("prompt_eval_count"), int):
                f.prompt_tokens = doc["prompt_eval_count"]
            if isinstance(doc.get("eval_count"), int):
                f.completion_tokens = doc["eval_count"]
        return out

    def finish(self) -> list[Piece]:
        return []

    @property
    def called_tools(self) -> bool:
        return self._n_calls > 0
