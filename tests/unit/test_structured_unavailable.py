"""Structured output when xgrammar cannot be imported: every constrained request (a JSON schema, a
grammar, a regex, Ollama's ``format``, a forced tool call) gets a 500 in its dialect's envelope whose
message names the cause, and unconstrained requests still work. The import failure is simulated in
this process (``sys.modules["xgrammar"] = None``, what Python does for a package it must not import),
through the faces' in-process test client around the tiny random model."""

from __future__ import annotations

import sys

import pytest
from servers import app_client

import kvserve.structured.xgr as xgr
from kvserve.errors import ServerFaultError

WHY = "import of xgrammar halted; None in sys.modules"  # Python's text for a module set to None
MESSAGE = f"structured output is unavailable: xgrammar failed to import: {WHY}"

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


@pytest.fixture
def no_xgrammar(monkeypatch):
    """xgrammar fails to import (restored afterwards, with xgr's state)."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(xgr, "_module", None)
    monkeypatch.setattr(xgr, "_failure", None, raising=False)


def test_the_import_failure_is_a_server_fault_naming_the_cause(no_xgrammar, monkeypatch):
    """Before: a bare ModuleNotFoundError. The first failure is remembered: no second import."""
    with pytest.raises(xgr.StructuredOutputUnavailableError) as e:
        xgr.xgrammar_module()
    assert str(e.value) == e.value.message == MESSAGE
    assert isinstance(e.value, ServerFaultError) and isinstance(e.value, ImportError)
    assert e.value.kind == "server"
    tries = []
    monkeypatch.setattr(xgr, "_import", lambda: tries.append(1))
    with pytest.raises(xgr.StructuredOutputUnavailableError, match="^" + MESSAGE + "$"):
        xgr.xgrammar_module()
    assert tries == []


def test_a_package_that_breaks_otherwise_is_named_with_its_error_type(monkeypatch):
    monkeypatch.setattr(xgr, "_module", None)
    monkeypatch.setattr(xgr, "_failure", None, raising=False)

    def broken():
        raise RuntimeError("undefined symbol: _ZN3c10")

    monkeypatch.setattr(xgr, "_import", broken)
    with pytest.raises(xgr.StructuredOutputUnavailableError) as e:
        xgr.xgrammar_module()
    assert e.value.message == ("structured output is unavailable: xgrammar failed to import: "
                               "RuntimeError: undefined symbol: _ZN3c10")


# (path, body, the error body the dialect's envelope gives)
_OPENAI = {"error": {"code": 500, "message": MESSAGE, "type": "server_error"}}
_OLLAMA = {"error": MESSAGE}
_ANTHROPIC = {"type": "error", "error": {"type": "api_error", "message": MESSAGE}}
CASES = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, _OPENAI),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "stream": True,
                              "response_format": {"type": "json_object"}}, _OPENAI),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": OPENAI_TOOLS,
                              "tool_choice": "required"}, _OPENAI),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": OPENAI_TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, _OPENAI),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "a+"}}, _OPENAI),
    ("/completion", {"prompt": "hi", "n_predict": 4, "grammar": 'root ::= "a"'}, _OPENAI),
    ("/completion", {"prompt": "hi", "n_predict": 4, "json_schema": SCHEMA, "stream": True}, _OPENAI),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA}}}, _OPENAI),
    ("/api/chat", {"messages": USER, "format": SCHEMA, "stream": False, "options": {"num_predict": 4}}, _OLLAMA),
    ("/api/chat", {"messages": USER, "format": "json", "options": {"num_predict": 4}}, _OLLAMA),  # streamed
    ("/api/generate", {"prompt": "hi", "format": "json", "stream": False, "options": {"num_predict": 4}}, _OLLAMA),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": SCHEMA}],
                      "tool_choice": {"type": "any"}}, _ANTHROPIC),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "stream": True,
                      "tools": [{"name": "f", "input_schema": SCHEMA}],
                      "tool_choice": {"type": "tool", "name": "f"}}, _ANTHROPIC),
]


def test_constrained_requests_get_the_cause_in_each_envelope(no_xgrammar, tiny_gguf, tmp_path):
    """Before: each got 500 "internal server error (the server log has the details)". Requests
    without a constraint still answer 200, before and after the constrained ones."""
    c = app_client(tiny_gguf, tmp_path)
    try:
        plain = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 3})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
        got = []
        for path, body, _ in CASES:
            r = c.post(path, json={"model": "tiny", **body})
            got.append((path, r.status_code, r.json()))
        assert got == [(path, 500, want) for path, _, want in CASES]
        for path, body in (("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 3}}),
                           ("/v1/messages", {"max_tokens": 3, "messages": USER}),
                           ("/completion", {"prompt": "hi", "n_predict": 3})):
            r = c.post(path, json={"model": "tiny", **body})
            assert r.status_code == 200, (path, r.text)
        assert c.get("/health").status_code == 200
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_the_cause_clients_see_names_files_without_their_directories(monkeypatch, caplog, tiny_gguf, tmp_path):
    """Before: the 500's text held the absolute paths of the server's packages (Python's import
    errors name the file they came from): a client learnt the server's directory layout (a user's
    home, the virtual environment). Now a client sees the file's name; the log has the whole text."""
    import logging

    monkeypatch.setattr(xgr, "_module", None)
    monkeypatch.setattr(xgr, "_failure", None, raising=False)
    so = "/home/alice/secret-project/.venv/lib/python3.12/site-packages/xgrammar/xgrammar_bindings.so"

    def broken():
        raise ImportError(f"{so}: undefined symbol: _ZN3c10\ncannot import name 'Grammar' from "
                          "'xgrammar.grammar' (/home/alice/secret-project/xgrammar/grammar.py)")

    monkeypatch.setattr(xgr, "_import", broken)
    want = ("structured output is unavailable: xgrammar failed to import: xgrammar_bindings.so: undefined "
            "symbol: _ZN3c10 cannot import name 'Grammar' from 'xgrammar.grammar' (grammar.py)")
    c = app_client(tiny_gguf, tmp_path)
    try:
        with caplog.at_level(logging.ERROR, logger="kvserve"):
            r = c.post("/api/chat", json={"model": "tiny", "messages": USER, "format": "json", "stream": False,
                                          "options": {"num_predict": 2}})
            r2 = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2,
                                                      "response_format": {"type": "json_object"}})
        assert (r.status_code, r.json()) == (500, {"error": want})
        assert (r2.status_code, r2.json()) == (500, {"error": {"code": 500, "message": want, "type": "server_error"}})
        assert "/home/alice" not in r.text + r2.text
        logged = [x.getMessage() for x in caplog.records if so in x.getMessage()]
        assert logged == ["structured output is unavailable: xgrammar failed to import: " + so +
                          ": undefined symbol: _ZN3c10\ncannot import name 'Grammar' from 'xgrammar.grammar' "
                          "(/home/alice/secret-project/xgrammar/grammar.py)"]
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_a_long_cause_is_cut_for_clients(monkeypatch):
    monkeypatch.setattr(xgr, "_module", None)
    monkeypatch.setattr(xgr, "_failure", None, raising=False)
    monkeypatch.setattr(xgr, "_import", lambda: (_ for _ in ()).throw(ImportError("x" * 5000)))
    with pytest.raises(xgr.StructuredOutputUnavailableError) as e:
        xgr.xgrammar_module()
    assert e.value.message == "structured output is unavailable: xgrammar failed to import: " + "x" * 497 + "..."
