"""The web page at ``/`` over HTTP (ASGI, no model loaded): who gets the page and who gets
Ollama's ``Ollama is running``, the assets under ``/webui/``, ``--no-webui``, ``--api-key`` and
``--path`` (a static directory, as llama-server's). The page in a browser: tests/browser/."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from kvserve.app import build_app
from kvserve.faces.webui import CSP, accepts_html, safe_file
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
PLAIN = "text/plain; charset=utf-8"
NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


def _app(*argv, path=None):
    st = ServerState(parse_args(["--no-preload", *argv]))
    if path is not None:
        st.args.path = str(path)  # llama-server's --path (its flag is added beside this face)
    return build_app(st)


def _call(app, method, url, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await c.request(method, url, headers=headers or {})

    return asyncio.run(go())


@pytest.fixture(scope="module")
def app():
    return _app()


def test_programs_get_ollama_is_running_browsers_get_the_page(app):
    for headers in ({}, {"Accept": "*/*"}, {"Accept": "application/json"}, {"Accept": "text/html;q=0"}):
        r = _call(app, "GET", "/", headers)
        assert (r.status_code, r.text, r.headers["content-type"]) == (200, "Ollama is running", PLAIN), headers
    r = _call(app, "HEAD", "/")
    assert (r.status_code, r.text, r.headers["content-type"]) == (200, "", PLAIN)
    r = _call(app, "GET", "/", {"Accept": BROWSER})
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["content-security-policy"] == CSP and r.headers["x-content-type-options"] == "nosniff"
    assert "Accept" in r.headers["vary"]
    assert '<script src="webui/app.js" defer></script>' in r.text and "<title>kvserve</title>" in r.text
    # no CDN, no inline script: every script and style comes from /webui/
    assert "http://" not in r.text and "https://" not in r.text and "<script>" not in r.text


def test_assets_are_served_from_the_package_and_nothing_else(app):
    want = {"app.js": "text/javascript; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8",
            "style.css": "text/css; charset=utf-8", "icon.svg": "image/svg+xml",
            "index.html": "text/html; charset=utf-8"}
    for name, ctype in want.items():
        r = _call(app, "GET", "/webui/" + name)
        assert (r.status_code, r.headers["content-type"]) == (200, ctype), name
        assert r.content
    for bad in ("/webui/nope.js", "/webui/../pyproject.toml", "/webui/%2e%2e/pyproject.toml",
                "/webui/__init__.py", "/webui/", "/webui/%2Fetc%2Fpasswd"):
        r = _call(app, "GET", bad)
        assert (r.status_code, r.json()) == (404, NOT_FOUND), bad


def test_no_webui_answers_plain_text_to_browsers_too():
    app = _app("--no-webui")
    r = _call(app, "GET", "/", {"Accept": BROWSER})
    assert (r.status_code, r.text, r.headers["content-type"]) == (200, "Ollama is running", PLAIN)
    r = _call(app, "GET", "/webui/app.js")
    assert (r.status_code, r.json()) == (404, NOT_FOUND)


def test_page_and_assets_are_public_under_api_key_the_api_is_not():
    app = _app("--api-key", "sekrit")
    assert _call(app, "GET", "/", {"Accept": BROWSER}).headers["content-type"] == "text/html; charset=utf-8"
    assert _call(app, "GET", "/webui/app.js").status_code == 200
    r = _call(app, "GET", "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["message"] == "Invalid API Key"
    assert _call(app, "GET", "/v1/models", {"Authorization": "Bearer sekrit"}).status_code != 401


def test_path_serves_a_static_directory_safely(tmp_path):
    site = tmp_path / "site"
    (site / "assets").mkdir(parents=True)
    (site / "index.html").write_text("<!doctype html><p>custom</p>")
    (site / "assets" / "a.js").write_text("console.log(1)")
    (site / ".secret").write_text("hidden")
    (tmp_path / "outside.txt").write_text("outside")
    os.symlink(tmp_path / "outside.txt", site / "link.txt")
    app = _app(path=site)
    r = _call(app, "GET", "/", {"Accept": BROWSER})
    assert (r.status_code, r.text) == (200, "<!doctype html><p>custom</p>")
    assert _call(app, "GET", "/").text == "Ollama is running"  # programs still get the plain answer
    for url in ("/webui/assets/a.js", "/assets/a.js"):
        r = _call(app, "GET", url)
        assert (r.status_code, r.text) == (200, "console.log(1)"), url
        assert r.headers["content-type"].startswith("text/javascript")
    for bad in ("/webui/../outside.txt", "/%2e%2e/outside.txt", "/link.txt", "/.secret", "/webui/.secret",
                "/nope.html", "/webui/app.js"):
        r = _call(app, "GET", bad)
        assert (r.status_code, r.json()) == (404, NOT_FOUND), bad
    # the API routes still answer as before (a GET on a POST route is still 404 File Not Found)
    assert _call(app, "GET", "/v1/chat/completions").json() == NOT_FOUND
    assert _call(app, "GET", "/health").json() == {"status": "ok"}  # --no-preload: ready at once


def test_path_under_api_key_only_the_page_is_public(tmp_path):
    """Issue 31 (it replaces review #16's rule): with ``--path DIR --api-key K`` only ``/``
    (DIR/index.html) is public, as in llama-server; every file of DIR, as ``/webui/<file>`` or
    ``/<file>``, needs the key (``/webui/<file>`` once served all of DIR without it)."""
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<!doctype html><p>custom</p>")
    (site / "notes.txt").write_text("private?")
    (site / "sub" / "a.js").write_text("console.log(1)")
    app = _app("--api-key", "sekrit", path=site)
    r = _call(app, "GET", "/", {"Accept": BROWSER})
    assert (r.status_code, r.text) == (200, "<!doctype html><p>custom</p>")
    for url in ("/webui/notes.txt", "/webui/sub/a.js", "/webui/index.html", "/notes.txt", "/sub/a.js",
                "/index.html", "/v1/models"):
        r = _call(app, "GET", url)
        assert (r.status_code, r.json()["error"]["message"]) == (401, "Invalid API Key"), url
        r = _call(app, "GET", url, {"Authorization": "Bearer sekrit"})
        assert r.status_code == 200, url
    assert _call(app, "GET", "/notes.txt", {"Authorization": "Bearer sekrit"}).text == "private?"
    assert _call(app, "GET", "/webui/.hidden", {"Authorization": "Bearer sekrit"}).status_code == 404


def test_safe_file_refuses_names_that_leave_the_root(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    root = tmp_path.resolve()
    assert safe_file(root, "a.txt") == root / "a.txt"
    for bad in ("", "/", "../a.txt", "/etc/passwd", "a.txt\x00", "..\\a.txt", ".a", "sub/../../a.txt", "."):
        assert safe_file(root, bad) is None, bad


def test_accepts_html():
    assert accepts_html(BROWSER) and accepts_html("TEXT/HTML") and accepts_html("text/html; q=0.5")
    assert not accepts_html("") and not accepts_html("*/*") and not accepts_html("text/html;q=0")
    assert not accepts_html("text/html;q=x") and not accepts_html("application/xhtml+xml")
