"""``kvserve serve``: the HTTP server (FastAPI + uvicorn): the faces assembled around the
serving state (:class:`~kvserve.serving.state.ServerState` and its model manager).

This module is the one place that knows both layers: ``kvserve.serving`` never imports
``kvserve.faces``; here the faces' routers are mounted and domain errors
(:mod:`kvserve.errors`) become each dialect's envelope.

Start-up order: the listening socket opens first, then the start-up model (``-m``, else the
default model; none with ``--no-preload``) loads in worker threads while ``/health`` answers
503 ``Loading model``. The log keeps
llama-server's line shapes and order (seed Example 1): the security warning,
``loading model``, ``initializing, n_slots = ...``, ``model loaded``, then
``listening on http://HOST:PORT``. That last line comes after the load, as in
llama-server, although the socket already accepts connections (and answers 503)
before it: a supervisor that waits for the line sees the same order as with
llama-server; one that polls /health sees the earlier listener.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve import startup as startup_gc
from kvserve.engine.request import InvalidRequestError
from kvserve.errors import KvserveError
from kvserve.faces.auth import add_api_guard, add_security, cors_policy
from kvserve.faces.connections import guarded_protocol
from kvserve.faces.drain import Drain, DrainMiddleware
from kvserve.faces.envelopes import DialectErrorMiddleware, dialect_of
from kvserve.faces.paths import ApiPrefixMiddleware, route_path
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import (
    BodyLimitMiddleware,
    HeadAsGetMiddleware,
    dumps,
    json_response,
)
from kvserve.faces.sse import ClientDisconnected
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

log = logging.getLogger("kvserve.server")

_T0 = time.monotonic()
_LEVELS = {logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}

class LlamaLogFormatter(logging.Formatter):
    """``0.00.003.284 I srv  llama_server: message`` (minutes.seconds.ms.us since start).

    The record's ``func`` extra (default: the logger's function name) is right-aligned
    in 12 characters, as llama-server's ``SRV_INF`` does.
    """

    def format(self, record: logging.LogRecord) -> str:
        us = int((record.created - _START_WALL) * 1e6)
        m, us = divmod(us, 60_000_000)
        s, us = divmod(us, 1_000_000)
        ms, us = divmod(us, 1000)
        func = getattr(record, "func", record.funcName)
        comp = getattr(record, "comp", "srv")
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"{m}.{s:02d}.{ms:03d}.{us:03d} {_LEVELS.get(record.levelno, 'I')} {comp}  {func:>12}: {msg}"


_START_WALL = time.time()


def setup_logging(verbosity: int) -> None:
    """Log to stderr in llama-server's shape; ``-lv`` >= 4 adds debug lines."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(LlamaLogFormatter())
    root = logging.getLogger("kvserve")
    root.handlers[:] = [h]
    root.setLevel(logging.DEBUG if verbosity >= 4 else logging.INFO)
    root.propagate = False


def _srv(level: int, func: str, msg: str, *a) -> None:
    log.log(level, msg, *a, extra={"func": func})


# -- the app ------------------------------------------------------------------------------

def _abandon_engine_starts() -> None:
    """SIGTERM/SIGINT: supervised engines still starting give up now (kvserve.supervisor.child),
    rather than holding the stop until their start timeout. Nothing to do when none was ever made."""
    child = sys.modules.get("kvserve.supervisor.child")
    if child is not None:
        child.abandon_starts()


def build_app(state: ServerState, gcp_settings=None) -> FastAPI:
    """The ASGI app: native and OpenAI faces, error envelopes, API keys, CORS; Vertex AI's predict
    route with ``gcp_settings`` enabled (default: :meth:`GcpSettings.from_env`; raises
    :class:`~kvserve.faces.gcp.PredictRouteConflict` when its route is taken)."""
    from kvserve.faces import anthropic, cors_proxy, embeddings, gcp, llama_api, ollama_api, responses, webui
    from kvserve.faces import tools_api
    from kvserve.faces import lora_api
    from kvserve.faces import router as router_face  # what vllm-router reads from a worker

    # no slash redirects: llama-server answers /health/ with 404, not 307
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.kv = state

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, e: ApiError):
        if e.status == 503 and e.message == "Loading model":  # the seed's exact member order
            return json_response({"error": {"message": e.message, "type": e.type, "code": 503}}, 503)
        return json_response(e.body(), e.status)

    @app.exception_handler(KvserveError)
    async def _domain_error(http: HttpRequest, e: KvserveError):
        return await _api_error(http, ApiError.from_exception(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HttpRequest, e: StarletteHTTPException):
        if e.status_code == 405 and dialect_of(route_path(http.scope)) == "ollama":
            # Ollama (gin, HandleMethodNotAllowed): a known /api path with another method is 405
            r = json_response({"error": "405 method not allowed"}, 405)
            r.headers.update(e.headers or {})  # Allow: the methods the path takes
            return r
        if e.status_code in (404, 405):  # llama-server: any unknown method + path is 404
            return json_response({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}},
                                 404)
        return json_response(ApiError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: HttpRequest, e: RequestValidationError):
        return json_response(ApiError(400, str(e)).body(), 400)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: HttpRequest, e: InvalidRequestError):
        # a client mistake found by the engine (context size, bad ids): 4xx, no traceback
        err = ApiError.from_exception(e)
        return json_response(err.body(), err.status)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: HttpRequest, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; the generation was aborted

    app.include_router(llama_api.build_router(state))
    app.include_router(embeddings.build_router(state))
    app.include_router(ollama_api.build_router(state))
    _include_openai(app, state)
    app.include_router(responses.build_router(state))
    app.include_router(anthropic.build_router(state))
    app.include_router(router_face.build_router(state))
    app.include_router(cors_proxy.build_router(state))
    app.include_router(tools_api.build_router(state))
    app.include_router(lora_api.build_router(state))  # VLLM_ALLOW_RUNTIME_LORA_UPDATING only
    app.include_router(webui.build_router(state))
    gcp.install(app, gcp_settings if gcp_settings is not None else gcp.GcpSettings.from_env())  # after every route
    # innermost first: the crash guard sits right outside the exception handlers above
    app.add_middleware(CrashGuardMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.args.max_request_bytes, unlimited=("/api/blobs/",))
    app.add_middleware(HeadAsGetMiddleware)
    add_security(app, state.args.api_keys, cors_policy(state.args), public_assets=not state.args.path)
    add_api_guard(app, state.args.host, keyed=bool(state.args.api_keys))  # /api: local origins and hosts only
    app.add_middleware(DialectErrorMiddleware)  # every error on /api and /v1/messages in its dialect
    app.state.drain = Drain(getattr(state.args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT))
    app.add_middleware(DrainMiddleware, drain=app.state.drain)  # SIGTERM: finish or end each request
    if getattr(state.args, "api_prefix", ""):  # outermost: every guard then sees the path below the prefix
        app.add_middleware(ApiPrefixMiddleware, prefix=state.args.api_prefix)
    if state.args.log_verbosity >= 4:  # -v / -lv 4: llama-server's request and response debug lines
        from kvserve.faces.http import RequestLogMiddleware

        app.add_middleware(RequestLogMiddleware, secrets=tuple(state.args.api_keys))
    return app


class CrashGuardMiddleware:
    """ASGI middleware: an exception no handler took is logged once (with its traceback) and
    answered with the 500 envelope, and the connection stays open for the next request.

    Registering ``Exception`` with ``app.exception_handler`` would not do: Starlette runs such a
    handler in ServerErrorMiddleware, which re-raises after answering, so uvicorn logs the
    traceback a second time and closes the keep-alive connection. When the response has
    already started (a stream), no answer can be sent: the error is logged and uvicorn ends
    the connection, the only way left to tell the client the response is incomplete.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            log.info("client disconnected before sending the whole body: %s %s", scope.get("method"),
                     scope.get("path"), extra={"func": "handle"})
        except Exception as e:  # noqa: BLE001 - the last stop before uvicorn
            log.exception("unhandled error", extra={"func": "handle"})
            if not started:
                err = ApiError.from_exception(e)
                await json_response(err.body(), err.status)(scope, receive, send)


def _include_openai(app: FastAPI, state: ServerState) -> None:
    """Mount the OpenAI face when it is present (it is built in parallel)."""
    try:
        from kvserve.faces import openai as openai_face
    except ImportError:
        return
    if hasattr(openai_face, "build_router"):
        app.include_router(openai_face.build_router(state))
    elif hasattr(openai_face, "register"):
        openai_face.register(app, state)


def _scheme(args) -> str:
    """``https`` when the server has a TLS key and certificate, else ``http``."""
    return "https" if getattr(args, "ssl_key_file", None) and getattr(args, "ssl_cert_file", None) else "http"


def http_protocol():
    """uvicorn's HTTP protocol class (httptools when installed, else h11, as ``http="auto"``)
    with its answer to an unparseable request in the error envelope: uvicorn writes a plain
    text ``Invalid HTTP request received.`` from ``send_400_response``, which the app never
    sees; overriding that method (a documented ``Config(http=...)`` class) is the one place. When
    the request's path was read before the error, the answer is in that route's dialect (Ollama's
    on ``/api``, Anthropic's on ``/v1/messages``: :mod:`kvserve.faces.envelopes`). With httptools,
    response header names go out as llama-server writes them (Title-Case, see
    :mod:`kvserve.faces.head_case`); h11 writes them as Starlette gives them (lower-case)."""
    from kvserve.faces.envelopes import dialect_error_body, dialect_of

    text = "Invalid HTTP request received."

    def answer(url: bytes | None) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        path = (url or b"").split(b"?", 1)[0].decode("latin-1")
        dialect = dialect_of(path)
        obj = dialect_error_body(dialect, 400, text) if dialect else ApiError(400, text).body()
        body = dumps(obj).encode()
        return body, [(b"Content-Type", b"application/json; charset=utf-8"),
                      (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        from kvserve.faces.head_case import TitleCaseHeads, title_case_name

        class JsonErrorHttpTools(TitleCaseHeads, HttpToolsProtocol):
            def send_400_response(self, msg: str) -> None:
                body, head = answer(getattr(self, "url", None))
                lines = [b"HTTP/1.1 400 Bad Request\r\n"]
                lines += [title_case_name(n) + b": " + v + b"\r\n"
                          for n, v in list(self.server_state.default_headers) + head]
                self.transport.write(b"".join(lines) + b"\r\n" + body)
                self.transport.close()

        return JsonErrorHttpTools
    except ImportError:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class JsonErrorH11(H11Protocol):
            def send_400_response(self, msg: str) -> None:
                body, head = answer(None)
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=head,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.close()

        return JsonErrorH11


def uvicorn_config(app, args=None, **kw):
    """The uvicorn Config ``kvserve serve`` runs with (``kw`` adds or overrides options).

    ``lifespan`` is off unless given: :func:`main` turns it on to start the preload; an app
    built in a test serves with no model loaded until a request names one.

    ``args`` (a :class:`~kvserve.serving.args.ServerArgs`) adds what its flags ask of uvicorn:
    TLS (``--ssl-key-file``/``--ssl-cert-file``, vLLM's ``--ssl-keyfile``/``--ssl-certfile``,
    ``--ssl-ca-certs``, ``--ssl-cert-reqs``, ``--ssl-ciphers``), ``--root-path``/``--api-prefix``,
    ``-to/--timeout/--timeout-keep-alive`` as the keep-alive timeout of an idle connection (seconds),
    ``--header-timeout`` and ``--limit-concurrency`` (:func:`~kvserve.faces.connections.guarded_protocol`)
    and ``--uvicorn-log-level``."""
    import uvicorn

    grace = getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT) if args is not None else 0.0
    # uvicorn's own deadline comes after DrainMiddleware's (--shutdown-timeout), which ends requests in their dialect
    bounds = {} if args is None else {"header_timeout": args.header_timeout,
                                      "max_connections": args.limit_concurrency}
    # ws="none": no route speaks WebSocket, and uvicorn's "auto" imports the websockets package (~20 ms of start-up)
    opts = dict(log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=grace + 3,
                http=guarded_protocol(http_protocol(), **bounds), ws="none")
    if args is not None:
        if args.ssl_key_file and args.ssl_cert_file:
            opts.update(ssl_keyfile=args.ssl_key_file, ssl_certfile=args.ssl_cert_file,
                        ssl_cert_reqs=args.ssl_cert_reqs)
            if args.ssl_ca_certs:
                opts["ssl_ca_certs"] = args.ssl_ca_certs
            if args.ssl_ciphers:
                opts["ssl_ciphers"] = args.ssl_ciphers
        if args.root_path:
            opts["root_path"] = args.root_path
        if args.timeout is not None:
            opts["timeout_keep_alive"] = args.timeout
        if args.uvicorn_log_level:
            opts["log_level"] = args.uvicorn_log_level
    opts.update(kw)
    return uvicorn.Config(app, **opts)


def _log_to_file(path: str) -> None:
    """``--log-file``: every kvserve log line also goes to ``path`` (appended)."""
    h = logging.FileHandler(path, encoding="utf-8")
    h.setFormatter(LlamaLogFormatter())
    logging.getLogger("kvserve").addHandler(h)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _log_listening(args) -> None:
    """``listening on http://HOST:PORT``, one line per ``--host`` address (llama-server #28690),
    then where to start: the chat page (unless ``--no-webui``) and an example request."""
    for host in args.hosts or [args.host]:
        shown = f"[{host}]" if ":" in host else host
        _srv(logging.INFO, "llama_server", "listening on %s://%s:%d", _scheme(args), shown, args.port)
    for line in start_here_lines(args):
        _srv(logging.INFO, "llama_server", "%s", line)


def start_here_lines(args) -> list[str]:
    """The last start-up lines: the chat page's URL and a request to try (curl), at the first
    address, reached through loopback when it is unspecified (0.0.0.0, ::); an API key is shown
    as a placeholder, never its value."""
    host = (args.hosts or [args.host])[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    base = f"{_scheme(args)}://{f'[{host}]' if ':' in host else host}:{args.port}"
    auth = ' -H "Authorization: Bearer $API_KEY"' if args.api_keys else ""
    body = '{"messages": [{"role": "user", "content": "Hello"}]}'
    lines = [f"chat page: {base}/"] if args.webui else []
    return lines + [f"try: curl {base}/v1/chat/completions -H \"Content-Type: application/json\"{auth} -d '{body}'"]


def add_startup(app: FastAPI, state: ServerState, on_fail) -> None:
    """On server start: remove the store's crash leftovers, preload the start-up model (unless
    ``--no-preload``) and start the keep_alive reaper; on shutdown unload every model. ``on_fail()`` is called when the
    preload fails (the server then exits, as llama-server does)."""

    async def startup() -> None:
        _clean_store(state)
        if getattr(state, "mcp", None):  # --mcp-servers-*: list their tools before the server answers
            from kvserve.tools.mcp import start_mcp

            await start_mcp(state)
        state.manager.start_reaper()
        # remote models (--remote, the store's REMOTE ones) are checked in the background: an unreachable
        # upstream does not delay the start
        state.remote_task = asyncio.get_running_loop().create_task(state.start_remotes())
        if state.args.preload or state.pinned:
            state.preload_task = asyncio.get_running_loop().create_task(_preload(state, on_fail))
        else:
            startup_gc.resume()
            _srv(logging.INFO, "llama_server", "no model preloaded (--no-preload): models load on demand")
            _log_listening(state.args)

    async def shutdown() -> None:
        if getattr(state, "mcp", None):
            await state.mcp.aclose()
        state.tools.close()  # the tools' process groups die with the server
        await state.manager.shutdown()

    app.router.on_startup.append(startup)
    app.router.on_shutdown.append(shutdown)


def _clean_store(state: ServerState) -> None:
    """Remove the store's crash leftovers (old temp and partial files: Store.clean_temp_files)."""
    from kvserve.store import open_store

    try:
        open_store(state.args.models_dir).clean_temp_files()
    except OSError as e:  # a read-only or missing store is not a reason to refuse to start
        _srv(logging.WARNING, "llama_server", f"store clean-up skipped: {e.strerror or e}")


async def _preload(state: ServerState, on_fail) -> None:
    from kvserve.loaders.weights import ModelLoadError

    args = state.args
    try:
        await state.preload()
        _srv(logging.INFO, "llama_server", "model loaded")
        _log_listening(args)
    except BaseException as e:  # noqa: BLE001 - reported, then the server exits
        from kvserve.serving.manager import LoadFailedError

        if isinstance(e, LoadFailedError):
            cause_type, text = e.cause_type, e.detail
        else:
            cause_type, text = type(e), str(e)
        known = issubclass(cause_type, (ModelLoadError, FileNotFoundError, KvserveError))  # the text says it all
        state.load_error = text if known else f"{cause_type.__name__}: {text}"
        _srv(logging.ERROR, "load_model", "failed to load model '%s': %s", args.model, state.load_error)
        _srv(logging.ERROR, "llama_server", "exiting due to model loading error")
        on_fail()
    finally:
        startup_gc.resume()  # the model is in (or failed): the collector runs again (kvserve.startup)


DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds (--shutdown-timeout)


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server that starts the app's :class:`~kvserve.faces.drain.Drain` on SIGTERM/SIGINT."""

        def __init__(self, config, drain: Drain):
            super().__init__(config)
            self.drain = drain

        def handle_exit(self, sig, frame) -> None:
            self.drain.begin()
            super().handle_exit(sig, frame)

    return DrainingServer


def _draining_server(config, drain: Drain):
    """A uvicorn server for ``config`` that begins ``drain`` when it is told to exit."""
    return _draining_server_class()(config, drain)


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status. The garbage collector is off
    from here (from before the imports under ``kvserve serve``) until the start-up model has loaded
    (:mod:`kvserve.startup`)."""
    startup_gc.pause()
    try:
        return _main(argv)
    finally:
        startup_gc.resume()


def _main(argv: list[str] | None) -> int:
    import uvicorn

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_verbosity)
    if args.log_disable:  # llama-server's --log-disable: nothing on stderr (--log-file still writes)
        logging.getLogger("kvserve").handlers[:] = []
        logging.getLogger("kvserve").addHandler(logging.NullHandler())
    if args.log_file:
        try:
            _log_to_file(args.log_file)
        except OSError as e:
            sys.stderr.write(f'error while handling argument "--log-file": {e}\n')
            return 2
    _srv(logging.INFO, "llama_server", "initializing ...")
    if args.mmap is not None:  # --mmap / --no-mmap: how GGUF weights are held (kvserve.loaders.gguf), here and in children
        os.environ["KVSERVE_MMAP"] = "1" if args.mmap else "0"
    else:
        from kvserve.serving.startup_checks import mmap_env_error

        if problem := mmap_env_error(os.environ):  # a typo is not taken as the default without a word
            _srv(logging.ERROR, "llama_server", "%s", problem)
            return 1
    for level, text in args.flag_notes:  # flags accepted without effect, or not available
        _srv(level, "llama_server", "%s", text)
    if not args.api_keys:
        cors_all = "*" in args.cors_origins
        _srv(logging.WARNING, "llama_server", "security: no API key is set%s",
             " and CORS allows all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)" if cors_all else "")
    from kvserve.faces.gcp import GcpSettings, PredictRouteConflict

    try:
        gcp = GcpSettings.from_env()
    except ValueError as e:
        _srv(logging.ERROR, "llama_server", "%s", e)
        return 1
    if gcp.enabled:  # Vertex AI (llama-server's GCP compat): AIP_HTTP_PORT wins over --port
        if args.port != gcp.port:
            _srv(logging.WARNING, "llama_server", "Google Cloud Platform compat: overriding server port %d "
                 "with AIP_HTTP_PORT %d", args.port, gcp.port)
        args.port = gcp.port
    args.engine_config().apply_threads()  # once per process (each model's core finds it set)
    state = ServerState(args)
    if args.mcp_servers_config or args.mcp_servers_json:  # a config that cannot be used refuses start-up
        from kvserve.tools.mcp import McpConfigError, McpUnavailableError, manager_from_args

        try:
            state.mcp = manager_from_args(args)
        except (McpConfigError, McpUnavailableError) as e:
            _srv(logging.ERROR, "llama_server", "MCP starting failed: %s", e)
            return 1
    try:
        app = build_app(state, gcp)
    except PredictRouteConflict as e:
        _srv(logging.ERROR, "llama_server", "%s", e)
        return 1
    socks: list[socket.socket] = []
    for host in args.hosts or [args.host]:  # llama-server: --host takes a comma-separated list (or repeated)
        try:
            socks.append(_listen(host, args.port))
            if args.port == 0:  # --port 0: the first address picks a free port, the others use it
                args.port = socks[0].getsockname()[1]
        except OSError as e:
            _srv(logging.ERROR, "llama_server", "couldn't bind HTTP server socket, hostname: %s, port: %d: %s",
                 host, args.port, e)
            for s in socks:
                s.close()
            return 1
    try:
        config = uvicorn_config(app, args, lifespan="on")
        config.load()  # TLS files are read here: a bad key or certificate fails before serving
    except (OSError, ValueError) as e:
        _srv(logging.ERROR, "llama_server", "couldn't start the HTTP server: %s", e)
        for s in socks:
            s.close()
        return 1
    server = _draining_server(config, app.state.drain)
    if state.mcp:  # SIGTERM/SIGINT: in-flight MCP calls end now, the servers' process groups die
        app.state.drain.on_begin.append(state.mcp.begin_stop)
    app.state.drain.on_begin.append(_abandon_engine_starts)
    failed = threading.Event()

    def on_fail() -> None:
        failed.set()
        server.should_exit = True

    add_startup(app, state, on_fail)
    startup_gc.freeze()  # the modules and the app: never freed, never walked by a full collection again
    server.run(sockets=socks)
    return 1 if failed.is_set() else 0
