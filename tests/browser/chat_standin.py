"""A scripted stand-in for a model server, for the chat page's tool-calling tests.

A language model's tool call cannot be made deterministic on a tiny random-weight model, so this
ASGI app (run by uvicorn in a thread on 127.0.0.1, a free port) plays the model: each
``POST /v1/chat/completions`` is recorded (its JSON body, in :attr:`ChatStandIn.chats`) and answered,
streamed as OpenAI's chunks, with the next scripted turn: text, or tool calls (``tool_call(...)``).
Everything else is real: the page is kvserve's own (:func:`kvserve.faces.webui.builtin_assets`,
with its Content-Security-Policy), and ``/tools`` is forwarded to a real kvserve started with
``--tools`` (``upstream``), recording each call (:attr:`ChatStandIn.tool_calls`) and the headers the
page sent. ``extra_tools`` add entries to ``GET /tools`` answered here (a stand-in for an MCP
server's tools, which need no real MCP server to test the page's confirmation rules);
``upstream=None`` and no extras answer ``/tools`` with :attr:`ChatStandIn.no_tools_status`: 404 (a
server without the route) or 403 ``this feature is disabled`` (llama-server and kvserve without
``--tools``).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.faces.webui import CSP, builtin_assets
from servers import free_port

MODEL = "scripted-model"


def tool_call(name: str, arguments: dict | str, call_id: str | None = None) -> dict:
    """One scripted tool call (arguments as a dict, or a raw string to test malformed ones)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "name": name, "arguments": args}


@dataclass
class ChatStandIn:
    """The running stand-in: ``url(path)``, the script (:meth:`script`), what it saw
    (:attr:`chats`: request bodies; :attr:`tool_calls`: ``{"body", "headers"}`` of each ``POST
    /tools``), and :meth:`stop`."""

    upstream: str | None = None
    extra_tools: list[dict] = field(default_factory=list)
    no_tools_status: int = 404
    chats: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    turns: list = field(default_factory=list)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, *turns) -> None:
        """The answers of the next completions, in order: a str (the text), a list of
        :func:`tool_call` dicts (an answer that calls them, finish_reason ``tool_calls``), or
        ``(finish_reason, calls)`` for another finish reason. Past the script: ``"(no more script)"``."""
        self.turns = list(turns)
        self.chats.clear()
        self.tool_calls.clear()

    # ------------------------------------------------------------------ the app

    def app(self) -> Starlette:
        assets = builtin_assets()
        client = httpx.AsyncClient(timeout=60)

        async def index(request: Request) -> Response:
            body, ctype = assets["index.html"]
            return Response(body, media_type=ctype, headers={"Content-Security-Policy": CSP})

        async def asset(request: Request) -> Response:
            found = assets.get(request.path_params["name"])
            if found is None:
                return Response("File Not Found", status_code=404)
            return Response(found[0], media_type=found[1])

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]})

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.chats.append(body)
            turn = self.turns.pop(0) if self.turns else "(no more script)"
            return StreamingResponse(_sse(turn, len(self.chats)), media_type="text/event-stream")

        async def list_tools(request: Request) -> Response:
            if self.upstream is None and not self.extra_tools:
                if self.no_tools_status == 403:
                    body = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
                else:
                    body = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
                return JSONResponse(body, status_code=self.no_tools_status)
            listed = []
            if self.upstream is not None:
                r = await client.get(self.upstream + "/tools")
                listed = r.json()
            return JSONResponse(listed + [e["entry"] for e in self.extra_tools])

        async def call(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw)
            headers = {k: v for k, v in request.headers.items() if k.startswith("x-tool") or k == "content-type"}
            self.tool_calls.append({"body": body, "headers": headers})
            for e in self.extra_tools:
                if e["entry"]["tool"] == body.get("tool"):
                    return JSONResponse({"plain_text_response": e["answer"]})
            req = client.build_request("POST", self.upstream + "/tools", content=raw, headers=headers)
            r = await client.send(req, stream=True)
            return StreamingResponse(r.aiter_raw(), status_code=r.status_code,
                                     media_type=r.headers.get("content-type"), background=BackgroundTask(r.aclose))

        return Starlette(routes=[
            Route("/", index), Route("/webui/{name:path}", asset), Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/tools", list_tools, methods=["GET"]), Route("/tools", call, methods=["POST"]),
        ])

    # ------------------------------------------------------------------ the process

    def start(self) -> ChatStandIn:
        self.port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the chat stand-in did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _chunk(n: int, delta: dict, finish: str | None = None) -> bytes:
    obj = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _sse(turn, n: int):
    """One scripted answer as OpenAI's stream: the role, the text in two pieces or each tool call
    in pieces (name, then the arguments split in two, as servers stream them), the finish reason,
    the usage chunk, [DONE]."""
    yield _chunk(n, {"role": "assistant", "content": ""})
    if isinstance(turn, str):
        half = len(turn) // 2
        for piece in (turn[:half], turn[half:]):
            yield _chunk(n, {"content": piece})
        finish = "stop"
    else:
        finish, calls = turn if isinstance(turn, tuple) else ("tool_calls", turn)
        for i, c in enumerate(calls):
            head = {"index": i, "type": "function", "function": {"name": c["name"], "arguments": ""}}
            if c["id"] is not None:
                head["id"] = c["id"]
            yield _chunk(n, {"tool_calls": [head]})
            half = len(c["arguments"]) // 2
            for piece in (c["arguments"][:half], c["arguments"][half:]):
                yield _chunk(n, {"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield _chunk(n, {}, finish)
    usage = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [],
             "usage": {"prompt_tokens": 10 * n, "completion_tokens": 5, "total_tokens": 10 * n + 5}}
    yield b"data: " + json.dumps(usage).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
