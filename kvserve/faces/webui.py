"""The face for people: the chat page at ``GET /`` and its assets under ``/webui/``.

A browser (a request whose ``Accept`` names ``text/html``) gets the page shipped in the
:mod:`kvserve.webui` package (``index.html`` plus the ``.js``/``.css``/``.svg`` files beside it,
read once when the router is built, served from a fixed table, so no path reaches the disk).
Programs that probe ``/`` (Ollama's clients, curl, health checks: ``Accept: */*`` or none) keep
getting Ollama's plain ``Ollama is running``, and so does everyone with ``--no-webui``.

With llama-server's ``--path DIR`` (``state.args.path``) the files of ``DIR`` replace the built-in
page: ``DIR/index.html`` at ``/`` for browsers, ``/webui/<file>`` and, as llama-server serves its
static directory at the root, any other ``GET /<file>`` that no route took. Names are resolved
inside ``DIR`` (``..``, absolute paths, symlinks leading out of it and dot-files are 404), and a
missing file is llama-server's 404 ``File Not Found``.

Under ``--api-key`` (:mod:`kvserve.faces.auth`) ``/`` and the built-in page's assets under
``/webui/`` are public, so a browser can load the page before it has the key. With ``--path DIR``
only ``/`` (``DIR/index.html``) is public, as in llama-server, which checks the key before its
static files: every other file of ``DIR``, as ``/webui/<file>`` or ``/<file>``, needs the key
(issue 31: ``/webui/<file>`` once served all of ``DIR`` without it).

When ``GET /tools`` lists tools (:mod:`kvserve.faces.tools_api`), the built-in page runs the model's
tool calls through ``POST /tools`` (its own agent loop, in ``app.js``); without them it is unchanged.

The built-in page sends a Content-Security-Policy that allows only its own scripts, styles and
same-origin requests: model text is rendered through text nodes (never ``innerHTML``), and the
policy is the second fence should that ever slip.
"""

from __future__ import annotations

import mimetypes
from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, Response

from kvserve.serving.state import ServerState

#: the plain answer programs get at ``/`` (Ollama's)
OLLAMA_RUNNING = "Ollama is running"
#: the asset types shipped in the package (pyproject's package data for kvserve.webui)
ASSET_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
#: the built-in page's policy: its own files only, requests to this server only
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                 "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache", "Vary": "Accept"}


def accepts_html(accept: str) -> bool:
    """True when an ``Accept`` header value names ``text/html`` with a non-zero ``q``
    (browsers' navigations do; ``*/*`` alone, as curl and Ollama's clients send, does not)."""
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() != "text/html":
            continue
        for p in params:
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    return float(v) > 0
                except ValueError:
                    return False
        return True
    return False


def builtin_assets() -> dict[str, tuple[bytes, str]]:
    """The files of the :mod:`kvserve.webui` package: ``{name: (bytes, content type)}`` for each
    ``.html``/``.js``/``.css``/``.svg`` file (flat: no sub-folders)."""
    out: dict[str, tuple[bytes, str]] = {}
    for f in resources.files("kvserve.webui").iterdir():
        ctype = ASSET_TYPES.get(Path(f.name).suffix)
        if ctype and f.is_file():
            out[f.name] = (f.read_bytes(), ctype)
    return out


def safe_file(root: Path, rel: str) -> Path | None:
    """The regular file ``rel`` names inside ``root`` (already resolved), or None: for names
    that climb out (``..``, absolute, a symlink pointing outside), dot-files, NUL bytes and
    anything that is not a regular file."""
    if not rel or "\x00" in rel or "\\" in rel:
        return None
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p.startswith(".") for p in parts):
        return None
    try:
        target = (root / Path(*parts)).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if not target.is_relative_to(root) or not target.is_file():
        return None
    return target


def _not_found() -> None:
    # the app's handler turns this into llama-server's 404 envelope (File Not Found)
    raise StarletteHTTPException(404)


def _plain() -> Response:
    return Response(OLLAMA_RUNNING, media_type="text/plain; charset=utf-8", headers={"Vary": "Accept"})


def build_router(state: ServerState) -> APIRouter:
    """The web UI's routes, bound to ``state``: ``GET /`` (page or plain text), ``GET
    /webui/{name}`` and, with ``--path``, ``GET /{name}`` for that directory's files. ``HEAD``
    is answered as ``GET`` by :class:`kvserve.faces.http.HeadAsGetMiddleware`."""
    r = APIRouter()
    enabled = bool(getattr(state.args, "webui", True))
    static_dir = getattr(state.args, "path", None)
    root = Path(static_dir).resolve() if static_dir else None
    assets = builtin_assets() if enabled and root is None else {}

    def serve_dir(rel: str) -> Response:
        target = safe_file(root, rel)
        if target is None:
            _not_found()
        ctype = ASSET_TYPES.get(target.suffix) or mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        return FileResponse(target, media_type=ctype)

    @r.get("/")
    async def index(http: HttpRequest) -> Response:
        if not enabled or not accepts_html(http.headers.get("accept", "")):
            return _plain()
        if root is not None:
            page = safe_file(root, "index.html")
            if page is None:
                return _plain()
            return FileResponse(page, media_type="text/html; charset=utf-8",
                                headers={"Cache-Control": "no-cache", "Vary": "Accept"})
        if "index.html" not in assets:  # an install without the package data
            return _plain()
        body, ctype = assets["index.html"]
        return Response(body, media_type=ctype, headers=_PAGE_HEADERS)

    if not enabled:
        return r

    # the path read from the request, not a typed parameter: FastAPI would build a pydantic field for
    # it (and import pydantic.v1 to check its type) at start-up
    @r.get("/webui/{name:path}")
    async def asset(http: HttpRequest) -> Response:
        name = http.path_params["name"]
        if root is not None:
            return serve_dir(name)
        found = assets.get(name)
        if found is None:
            _not_found()
        body, ctype = found
        return Response(body, media_type=ctype, headers={"X-Content-Type-Options": "nosniff",
                                                         "Cache-Control": "no-cache"})

    if root is not None:
        @r.get("/{name:path}")
        async def static_file(http: HttpRequest) -> Response:  # llama-server serves --path at the root
            return serve_dir(http.path_params["name"])

    return r
