"""POST /api/create on a real server (issue #13 items 3 and 4), through the official ``ollama``
client unchanged: ``create_blob`` + ``create(files=...)``, ``create(from_=..., system=...,
parameters=...)``, then chat with the new model and ``show`` it; a model with a TEMPLATE layer
renders its chats with that Go template in every face (/api/chat, /api/generate,
/v1/chat/completions, /apply-template: the prompt the engine got, and its token count, are the
tokenized Go rendering); a model without one keeps its GGUF's Jinja template; its SYSTEM layer is
the default system message everywhere. One server on a temporary store, the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

ollama = pytest.importorskip("ollama")

from kvserve.chat.go_template import OllamaTemplate
from kvserve.store import Store

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name a color."}]
GO_CHATML = (Path(__file__).resolve().parents[1] / "templates" / "chatml_tools.gotmpl").read_text()
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from test_ollama_client import Serve

    home = tmp_path_factory.mktemp("chome")
    (home / "models").mkdir()
    s = Serve(home, "--no-preload", "-c", "1024", "-np", "1")
    s.home = home
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.base_url)


@pytest.fixture(scope="module")
def store(srv) -> Store:
    return Store(srv.home / "models")


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    from kvserve.loaders.tokenizer import Tokenizer

    return Tokenizer.from_gguf_file(tiny_gguf)


@pytest.fixture(scope="module")
def tiny(client, tiny_gguf, store):
    """``tiny`` created from the tiny GGUF with create_blob + create(files=...)."""
    digest = client.create_blob(tiny_gguf)
    assert store.has_blob(digest)
    r = client.create(model="tiny", files={"tiny.gguf": digest})
    assert r.status == "success"
    return digest


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120)


def _ids(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special=False, parse_special=True)
    return ([tok.bos_token_id] if tok.add_bos else []) + ids


def _blobs(store: Store) -> int:
    return sum(p.stat().st_size for p in store.blobs_dir.iterdir())


def test_create_from_files_streams_ollamas_statuses(client, srv, tiny, store):
    parts = list(client.create(model="tiny2", files={"tiny.gguf": tiny}, stream=True))
    assert [p.status for p in parts] == ["parsing GGUF", f"using existing layer {tiny}", "writing manifest",
                                         "success"]
    assert {m.model for m in client.list().models} >= {"tiny:latest", "tiny2:latest"}
    assert store.require("tiny2").manifest.layer("model").digest == tiny
    client.delete("tiny2")
    assert store.has_blob(tiny)  # tiny still uses it


def test_create_from_a_model_with_system_and_parameters(client, srv, tiny, store):
    before = _blobs(store)
    r = client.create(model="terse", from_="tiny", system="You are terse.",
                      parameters={"num_predict": 3, "temperature": 0})
    assert r.status == "success"
    t = store.require("terse").manifest
    assert t.layer("model").digest == store.require("tiny").manifest.layer("model").digest == tiny
    assert _blobs(store) - before < 1024  # a system and a params layer, the weights are shared
    show = client.show("terse")
    assert _post(srv, "/api/show", {"model": "terse"}).json()["system"] == "You are terse."  # not in the client's type
    assert show.parameters == "num_predict                    3\ntemperature                    0"
    assert "SYSTEM You are terse.\n" in show.modelfile and "PARAMETER num_predict 3\n" in show.modelfile
    reply = client.chat(model="terse", messages=ASK)
    assert reply.done and reply.eval_count == 3  # num_predict from the params layer
    # no TEMPLATE: the GGUF's Jinja (ChatML) template, with the SYSTEM layer first, in every face
    jinja = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n" \
            "<|im_start|>assistant\n"
    assert _post(srv, "/apply-template", {"model": "terse", "messages": ASK}).json()["prompt"] == jinja
    assert _post(srv, "/apply-template", {"model": "tiny", "messages": ASK}).json()["prompt"] == \
        jinja.removeprefix("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_a_template_layer_renders_in_every_face(client, srv, tiny, store, tok):
    r = client.create(model="tiny-go", from_="tiny", template=GO_CHATML, system="You are terse.")
    assert r.status == "success"
    show = client.show("tiny-go")
    assert show.template == GO_CHATML and "tools" in show.capabilities
    go = OllamaTemplate(GO_CHATML)
    system = [{"role": "system", "content": "You are terse."}]

    # /api/chat first: a fresh runner evaluates the whole prompt
    msgs = [{"role": "user", "content": "Say hi."}]
    want = go.render(system + msgs)
    assert want.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi.")
    chat = client.chat(model="tiny-go", messages=msgs, options={"temperature": 0, "num_predict": 2})
    assert chat.prompt_eval_count == len(_ids(tok, want))
    assert _post(srv, "/apply-template", {"model": "tiny-go", "messages": msgs}).json()["prompt"] == want

    # /v1/chat/completions: the usage counts the tokenized Go rendering exactly
    want = go.render(system + ASK)
    r = _post(srv, "/v1/chat/completions", {"model": "tiny-go", "messages": ASK, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(_ids(tok, want))
    assert _post(srv, "/apply-template", {"model": "tiny-go", "messages": ASK}).json()["prompt"] == want

    # /api/generate: the prompt's ids lead the returned context
    g = client.generate(model="tiny-go", prompt="Count to three.", options={"temperature": 0, "num_predict": 2})
    ids = _ids(tok, go.render(system + [{"role": "user", "content": "Count to three."}]))
    assert list(g.context[:len(ids)]) == ids

    # tools and an earlier call with its result: .Tools and .ToolCalls
    history = [{"role": "user", "content": "Read pom.xml"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "pom.xml"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "<project/>"}]
    prompt = _post(srv, "/apply-template", {"model": "tiny-go", "messages": history, "tools": [READ_FILE]}).json()["prompt"]
    assert prompt == go.render(system + history, tools=[READ_FILE])
    assert '<tools>\n{"type":"function","function":{"name":"read_file"' in prompt
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path":"pom.xml"}}\n</tool_call>' in prompt


def test_re_creating_a_loaded_model_reloads_it(client, srv, tiny):
    assert client.create(model="tiny-go2", from_="tiny", template=GO_CHATML, system="One.").status == "success"
    assert _post(srv, "/apply-template", {"model": "tiny-go2", "messages": ASK}).json()["prompt"].startswith(
        "<|im_start|>system\nOne.<|im_end|>")
    assert client.create(model="tiny-go2", from_="tiny-go2", system="Two.").status == "success"
    assert _post(srv, "/apply-template", {"model": "tiny-go2", "messages": ASK}).json()["prompt"].startswith(
        "<|im_start|>system\nTwo.<|im_end|>")
    client.delete("tiny-go2")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_errors_are_ollamas(client, srv, tiny, store):
    cases = [
        ({"model": "x", "from": "tiny", "quantize": "q4_K_M"}, 501, "quantize is not supported yet"),
        ({"model": "x", "from": "tiny", "template": "{{ .Prompt"}, 400, "template error: "),
        ({"model": "x"}, 400, "neither 'from' or 'files' was specified"),
        ({"model": "bad name!", "from": "tiny"}, 400, "invalid model name"),
        ({"model": "x", "files": {"../w.gguf": tiny}}, 400, "file path must be relative"),
        ({"model": "x", "from": "tiny", "adapters": {"a.gguf": tiny}}, 400, "the ADAPTER file a.gguf is not a LoRA adapter"),
    ]
    for body, status, text in cases:
        with pytest.raises(ollama.ResponseError) as e:
            client.create(**{("from_" if k == "from" else k): v for k, v in body.items()})
        assert e.value.status_code == status and text in e.value.error, body
        r = _post(srv, "/api/create", {**body, "stream": False})
        assert r.status_code == status and set(r.json()) == {"error"} and text in r.json()["error"]
    # an error after the first status is the stream's last line
    r = _post(srv, "/api/create", {"model": "x", "files": {"w.gguf": "sha256:" + "0" * 64}})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert r.status_code == 200 and lines == [{"status": "parsing GGUF"}, {"error": f'blob "sha256:{"0" * 64}" not found'}]
    # a base model the store lacks is pulled first, as Ollama does: from a closed port, at once
    missing = f"127.0.0.1:{_closed_port()}/library/base:latest"
    r = _post(srv, "/api/create", {"model": "x", "from": missing})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and lines[-1]["error"].startswith("pull model manifest: ")
    assert store.get("x") is None
