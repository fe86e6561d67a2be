""":class:`RemoteRunner`: a remote model held by the model manager like a loaded model.

Every face reaches it through the same two calls as a local model:
:func:`kvserve.serving.chat_plan.plan_chat` returns :meth:`RemoteRunner.plan_chat`'s plan (the
chat request kept whole, no prompt rendered: the upstream renders its own), and
:func:`kvserve.serving.choices.chat_events` yields :meth:`RemoteRunner.chat_events`'s events: the
upstream's stream as kvserve's typed pieces, its finish and usage, so each face writes its own
dialect unchanged.

No memory is counted for it, it is pinned (never unloaded by keep_alive or to make room) and it
does not count against ``--max-models``; its requests are counted in its metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx

from kvserve.engine.request import Request, RequestOutput, Timings
from kvserve.errors import (
    BadGatewayError,
    InvalidInputError,
    NotSupportedError,
    ServerFaultError,
    UnavailableError,
)
from kvserve.remote.check import RemoteCheck, same_origin
from kvserve.remote.spec import RemoteSpec
from kvserve.remote.upstream import (
    MAX_ERROR_BYTES,
    MAX_EVENT_BYTES,
    MAX_STREAM_BYTES,
    OllamaStream,
    OpenAIStream,
    UpstreamProtocolError,
    error_message,
    ollama_body,
    openai_body,
)
from kvserve.serving.chat_output import Answer, OutputMode, ReasoningPiece, TextPiece, ToolCallPiece

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.chat_plan import Plan
    from kvserve.serving.chat_request import ChatRequest
    from kvserve.serving.choices import ChatEvent

log = logging.getLogger("kvserve.server")

__all__ = ["CONNECT_TIMEOUT_S", "DEFAULT_MAX_CHUNKS", "READ_TIMEOUT_S", "RemoteEngineFacts", "RemoteRunner",
           "estimate_tokens"]

CONNECT_TIMEOUT_S = 10.0
#: seconds the upstream may go without sending a piece of the answer (bytes that carry none, such
#: as keep-alive comments and empty deltas, do not count)
READ_TIMEOUT_S = 300.0
#: answer pieces (about tokens) a request without max_tokens may receive
DEFAULT_MAX_CHUNKS = 32768
#: a context size that never limits: the upstream applies its own
_NO_LIMIT = 1 << 30


def estimate_tokens(text: str) -> int:
    """A token count for text the upstream gave no usage for: one token per 4 UTF-8 bytes,
    rounded up (the usual rule of thumb for English BPE vocabularies)."""
    return math.ceil(len(text.encode("utf-8")) / 4) if text else 0


class RemoteEngineFacts:
    """``runner.engine`` of a remote model: the :class:`~kvserve.serving.runner_protocol.EngineFacts`
    faces read. No model file, no tokenizer; the context is the upstream's (never limited here).
    ``remote`` marks it (model lists show the upstream instead of a file's metadata)."""

    model_info = None
    tokenizer = None
    stats = None
    error = None
    remote = True

    def __init__(self):
        self.n_ctx = self.n_ctx_slot = _NO_LIMIT
        self.n_slots = 1


class RemoteNotSupportedError(NotSupportedError, AttributeError):
    """What a remote model has not: a tokenizer, slots (501 in every face; an AttributeError too,
    so ``getattr(x, name, default)`` probes get their default)."""


class _Absent:
    """A remote model's ``tokenizer`` and ``slots``: false, and any use of them is a 501 naming the
    model (``/tokenize``, ``/completion``, ``/slots``...: the upstream tokenizes and schedules)."""

    def __init__(self, model: str, what: str):
        self._model, self._what = model, what

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RemoteNotSupportedError(f"model '{self._model}' is a remote model: kvserve has no {self._what} for it "
                                      "(it serves chat: /v1/chat/completions, /v1/responses, /v1/messages, /api/chat, "
                                      "/api/generate)")


class _Bounded:
    """The lines of a streamed response body, each at most :data:`MAX_EVENT_BYTES`, all of them
    at most :data:`MAX_STREAM_BYTES` (raises UpstreamProtocolError beyond)."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.total = 0

    async def lines(self) -> AsyncIterator[str]:
        buf = b""
        async for chunk in self.response.aiter_raw():
            self.total += len(chunk)
            if self.total > MAX_STREAM_BYTES:
                raise UpstreamProtocolError(f"the upstream sent more than {MAX_STREAM_BYTES >> 20} MiB")
            buf += chunk
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line, buf = buf[:nl], buf[nl + 1:]
                yield line.rstrip(b"\r").decode("utf-8", "replace")
            if len(buf) > MAX_EVENT_BYTES:
                raise UpstreamProtocolError(f"the upstream sent an event over {MAX_EVENT_BYTES >> 20} MiB")
        if buf.strip():
            yield buf.decode("utf-8", "replace")


class RemoteRunner:
    """A remote model as the model manager and the faces hold it (the runner protocol,
    :class:`kvserve.serving.runner_protocol.ModelRunner`).

    Args:
        remote: the :class:`RemoteSpec` (where the upstream is, its dialect, model and key's env var).
        args: the server's ServerArgs (read: ``reasoning_parser`` by the faces, nothing else here).
        model_spec: the manager's :class:`~kvserve.serving.manager.ModelSpec` it was loaded for
            (default: ``ModelSpec(remote.name, pinned=True, remote=True)``).
        build_info: the server's build string (``system_fingerprint``).
        on_close: called once by :meth:`close` (after in-flight requests were cancelled): a
            supervisor stops its child engine there.
        transport: an httpx async transport (tests); None: the network.

    Attributes (beyond the protocol's): ``remote`` (the RemoteSpec), ``last_check`` (the latest
    :class:`RemoteCheck`, start-up's or one a request's outcome implies), ``available``.
    """

    task = "generate"

    def __init__(self, remote: RemoteSpec, args: Any, *, model_spec: Any = None, build_info: str = "",
                 on_close: Callable[[], None] | None = None, transport: httpx.AsyncBaseTransport | None = None):
        from kvserve.serving.manager import ModelSpec
        from kvserve.serving.metrics import Metrics

        self.remote = remote
        self.args = args
        self.spec = model_spec if model_spec is not None else ModelSpec(remote.name, pinned=True, remote=True)
        self.engine: RemoteEngineFacts | None = RemoteEngineFacts()
        self.tokenizer = _Absent(self.spec.name, "tokenizer")
        self.template = None
        self.slots = _Absent(self.spec.name, "slots")
        self.grammars = None
        self.model_alias = self.spec.name
        self.served_names = self.spec.served_names()
        self.model_path = ""
        from kvserve.engine.request import SamplingParams

        self.default_params = SamplingParams()
        self.generation = None
        self.build_info = build_info
        self.measured_bytes = 0
        self.last_check: RemoteCheck | None = None
        self.running = 0
        self.requests_total = 0
        self.failures_total = 0
        self.usage_estimated_total = 0
        self._on_close = on_close
        self._transport = transport
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.metrics = Metrics(self)

    # -- the runner protocol

    @property
    def ready(self) -> bool:
        return not self._closed

    @property
    def device(self) -> str:
        return "remote"

    @property
    def available(self) -> bool:
        """False when the latest check or request found no usable upstream."""
        return self.last_check is None or self.last_check.ok

    def require_ready(self) -> None:
        if self._closed:
            raise ServerFaultError(f"model '{self.model_alias}' was unloaded")

    def require_generative(self) -> None:
        """A remote model generates text."""

    def engine_counts(self) -> tuple[int, int, float]:
        return self.running, 0, 0.0

    def needs_reload(self, spec: Any) -> bool:
        return False

    def close(self) -> None:
        """Stop taking requests (those in flight end when their connection closes) and call
        ``on_close``."""
        self._closed = True
        self.metrics.freeze()
        if self._on_close is not None:
            cb, self._on_close = self._on_close, None
            try:
                cb()
            except Exception:  # noqa: BLE001 - a failing hook must not stop the unload
                log.exception("remote model '%s': on_close failed", self.model_alias)

    # -- planning and running

    def plan_chat(self, req: "ChatRequest") -> "Plan":
        """The plan of a chat request for this model: the request kept whole (``plan.remote``);
        one placeholder engine request (faces read its sampling params and count its prompt
        as 0 tokens). Checks now what cannot be forwarded (NotSupportedError, 501).
        Raises InvalidInputError for sampling values kvserve refuses anyway."""
        from kvserve.engine.request import SamplingParams
        from kvserve.serving.chat_plan import Plan, apply_sampling

        self.require_ready()
        self._body(req)  # refuses what cannot be forwarded, before a stream starts
        if not req.messages and not req.messages_may_be_empty:
            raise InvalidInputError("'messages' must not be empty")
        params = apply_sampling(SamplingParams(), {k: v for k, v in req.sampling.items() if k != "n_predict_default"})
        stub = Request(f"{req.request_id}-0", [], params, owner=req.owner)
        return Plan("chat", req.request_id, int(time.time()), self.model_alias, [stub], n=1,
                    stream=req.stream.stream, include_usage=req.stream.include_usage, mode=OutputMode(),
                    remote=req)

    def _body(self, req: "ChatRequest") -> dict:
        make = openai_body if self.remote.dialect == "openai" else ollama_body
        return make(req, self.remote.upstream_model, self.remote.name)

    def _scrub(self, text: str) -> str:
        key = self.remote.api_key()
        return text.replace(key, "***") if key else text

    def _fail(self, exc: Exception, outcome: str | None = None) -> Exception:
        """Count a failed request; a connection failure marks the model unavailable."""
        self.failures_total += 1
        if outcome is not None:
            self.last_check = RemoteCheck(outcome, getattr(exc, "message", str(exc)))
        return exc

    async def chat_events(self, plan: "Plan", *, whole: bool = False, progress: bool = False) \
            -> AsyncIterator["ChatEvent"]:
        """The upstream's answer to ``plan`` as :class:`~kvserve.serving.choices.ChatEvent` s
        (the contract of :func:`kvserve.serving.choices.chat_events`): one event per upstream
        event with pieces, the last with the finish, ``called_tools`` and the usage (the
        upstream's, else estimated from the text with :func:`estimate_tokens`, logged as such);
        ``whole``: only the last event, with the whole :class:`Answer`.

        Closing the iterator (client disconnect) closes the upstream connection: the upstream
        sees its client leave and stops.

        Raises:
            UnavailableError (503): no server at the base URL, or the upstream is busy (429/503).
            BadGatewayError (502): the upstream refused (401: the key) or failed, sent a stream that
                is not its dialect's or over the bounds, or died mid-stream; the text names the
                model and the upstream's reason (its error body capped at 4 KiB, the key never).
            InvalidInputError (400): the upstream found the request bad (400/413/422): its text.
        """
        req = plan.remote
        self.require_ready()
        body = self._body(req)
        n_predict = req.sampling.get("n_predict", -1) or -1
        # an upstream sends at least one token per piece: more pieces than max_tokens means it ignores
        # the limit; it is cut there (finish "length")
        max_chunks = n_predict if n_predict > 0 else DEFAULT_MAX_CHUNKS
        parser = OpenAIStream() if self.remote.dialect == "openai" else OllamaStream()
        rid = plan.requests[0].request_id
        t0 = time.monotonic()
        t_first: float | None = None
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallPiece] = []
        n_out = 0
        cut = False
        self.running += 1
        self.requests_total += 1
        arrival = plan.requests[0].arrival_time
        try:
            async with self._client() as client:
                async with self._open(client, body) as resp:
                    bounded = _Bounded(resp)
                    last_piece = time.monotonic()
                    async for line in bounded.lines():
                        # keep-alive comments and empty deltas are no answer: they do not reset the bound
                        if time.monotonic() - last_piece > READ_TIMEOUT_S:
                            raise httpx.ReadTimeout("no answer piece")
                        data = self._payload(line)
                        if data is None:
                            continue
                        pieces = parser.feed(data)
                        if parser.error is not None:
                            raise self._fail(BadGatewayError(self._scrub(
                                f"remote model '{self.model_alias}': the upstream failed: {parser.error}")))
                        if parser.chunks > max_chunks:  # past max_tokens: the upstream did not stop
                            cut = True
                            break
                        if not pieces:
                            continue
                        last_piece = time.monotonic()
                        if t_first is None:
                            t_first = time.monotonic()
                        for p in pieces:
                            (texts if type(p) is TextPiece else reasoning if type(p) is ReasoningPiece
                             else calls).append(p.text if type(p) is not ToolCallPiece else p)
                        n_out += len(pieces)
                        if not whole:
                            out = RequestOutput(rid, [], "".join(p.text for p in pieces if type(p) is TextPiece),
                                                num_output_tokens=n_out, arrival_time=arrival)
                            yield _event(out, pieces)
                    else:
                        if parser.final.finish_reason is None and not parser.called_tools:
                            raise UpstreamProtocolError("the upstream's stream ended before its answer did")
        except httpx.TimeoutException as e:
            connect = isinstance(e, httpx.ConnectTimeout)
            raise self._fail(UnavailableError(
                f"remote model '{self.model_alias}': no server at the base URL {self.remote.shown_url} "
                f"(no answer within {CONNECT_TIMEOUT_S:g} s)") if connect else BadGatewayError(
                f"remote model '{self.model_alias}': the upstream sent nothing for {READ_TIMEOUT_S:g} s"),
                "no_server" if connect else None) from None
        except httpx.ConnectError as e:
            raise self._fail(UnavailableError(
                f"remote model '{self.model_alias}': no server at the base URL {self.remote.shown_url} "
                f"({_short(e)})"), "no_server") from None
        except (httpx.TransportError, UpstreamProtocolError) as e:
            raise self._fail(BadGatewayError(
                f"remote model '{self.model_alias}': the upstream's answer broke off: {_short(e)}")) from None
        finally:
            self.running -= 1
        if self.last_check is None or not self.last_check.ok:
            self.last_check = RemoteCheck("ok", f"ok: {self.remote.shown_url} answered a request")
        tail = [] if cut else parser.finish()
        calls += [p for p in tail if type(p) is ToolCallPiece]
        final = parser.final
        text = "".join(texts)
        estimated = final.completion_tokens is None or final.prompt_tokens is None
        prompt_n = final.prompt_tokens if final.prompt_tokens is not None else \
            estimate_tokens("".join(_message_text(m) for m in req.messages))
        out_n = final.completion_tokens if final.completion_tokens is not None else \
            estimate_tokens(text + "".join(reasoning) + "".join(c.arguments for c in calls))
        if estimated:
            self.usage_estimated_total += 1
            log.info("remote model '%s': the upstream gave no usage: counts estimated from the text "
                     "(prompt %d, completion %d tokens, 4 bytes a token)", self.model_alias, prompt_n, out_n,
                     extra={"func": "remote"})
        stop = "limit" if cut or final.finish_reason == "length" else "eos"
        now = time.monotonic()
        first = t_first if t_first is not None else now
        timings = Timings(prompt_n=prompt_n, prompt_ms=(first - t0) * 1e3, predicted_n=out_n,
                          predicted_ms=(now - first) * 1e3)
        last = RequestOutput(rid, [], "", finished=True, stop_type=stop, num_prompt_tokens=prompt_n,
                             num_cached_tokens=final.cached_tokens, num_output_tokens=out_n, timings=timings,
                             arrival_time=arrival)
        from kvserve.serving.choices import ChatEvent, ChatUsage

        ev = ChatEvent(0, last, [] if whole else list(tail), finish_reason=last.finish_reason,
                       called_tools=bool(calls))
        if whole:
            ev.answer = Answer(text, "".join(reasoning) if reasoning else None, _numbered(calls))
        ev.usage = ChatUsage(prompt_n, out_n, final.cached_tokens, final.reasoning_tokens)
        ev.usage.estimated = estimated
        self.metrics.on_output(last)  # the request and its prompt tokens (vLLM's families)
        if out_n:  # no token ids came: the generated tokens counted from the upstream's usage
            self.metrics.vllm.generation_tokens.inc(out_n)
        yield ev

    def _client(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        return httpx.AsyncClient(timeout=timeout, follow_redirects=False, transport=self._transport,
                                 trust_env=False)

    def _open(self, client: httpx.AsyncClient, body: dict):
        runner = self

        class _Open:
            async def __aenter__(self):
                url = runner.remote.url("chat")
                for _hop in range(4):
                    req = client.build_request("POST", url, json=body, headers=runner.remote.headers())
                    self.resp = await client.send(req, stream=True)
                    r = self.resp
                    if r.is_redirect:
                        nxt = r.url.join(r.headers.get("location", ""))
                        await r.aclose()
                        if not same_origin(r.url, nxt):
                            raise runner._fail(BadGatewayError(
                                f"remote model '{runner.model_alias}': the upstream redirects to another host "
                                f"({nxt.scheme}://{nxt.host}); kvserve does not follow it"))
                        if r.status_code not in (307, 308):
                            raise runner._fail(BadGatewayError(
                                f"remote model '{runner.model_alias}': the upstream answered {r.status_code} "
                                "(a redirect that drops the request body)"))
                        url = str(nxt)
                        continue
                    if r.status_code >= 400:
                        raw = b""
                        async for chunk in r.aiter_raw():
                            raw += chunk
                            if len(raw) >= MAX_ERROR_BYTES:
                                break
                        await r.aclose()
                        raise runner._status_error(r.status_code, raw)
                    return r
                raise runner._fail(BadGatewayError(f"remote model '{runner.model_alias}': too many redirects"))

            async def __aexit__(self, *exc):
                await self.resp.aclose()
                return False

        return _Open()

    def _status_error(self, status: int, raw: bytes) -> Exception:
        reason = self._scrub(error_message(status, raw))
        name = self.model_alias
        if status in (401, 403):
            self.last_check = RemoteCheck("rejected", "rejected: check the API key", status=status)
            return self._fail(BadGatewayError(f"remote model '{name}': the upstream rejected the key "
                                              f"({status}: {reason}): check the API key"))
        if status in (400, 413, 422):
            return self._fail(InvalidInputError(f"remote model '{name}': the upstream refused the request: {reason}"))
        if status in (429, 503):
            return self._fail(UnavailableError(f"remote model '{name}': the upstream is busy ({status}: {reason})"))
        if status == 501:
            return self._fail(NotSupportedError(f"remote model '{name}': the upstream does not support it: {reason}"))
        return self._fail(BadGatewayError(f"remote model '{name}': the upstream answered {status}: {reason}"))

    def _payload(self, line: str) -> str | None:
        """The JSON text of one line: SSE ``data:`` payloads (OpenAI), whole lines (Ollama)."""
        if self.remote.dialect == "ollama":
            return line if line.strip() else None
        if line.startswith("data:"):
            return line[5:].strip()
        if line.startswith("{"):  # an error object sent as plain JSON in an event stream
            return line
        return None

    async def check(self) -> RemoteCheck:
        """Run :func:`~kvserve.remote.check.check_remote` now (worker thread) and keep its result."""
        from kvserve.remote.check import check_remote

        self.last_check = await asyncio.to_thread(check_remote, self.remote)
        return self.last_check


def _event(out: RequestOutput, pieces: list) -> "ChatEvent":
    from kvserve.serving.choices import ChatEvent

    return ChatEvent(0, out, list(pieces))


def _numbered(calls: list[ToolCallPiece]) -> list[ToolCallPiece]:
    return [ToolCallPiece(k, c.id, c.name, c.arguments) for k, c in enumerate(calls)]


def _message_text(m: Any) -> str:
    if not isinstance(m, dict):
        return ""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
    return ""


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
