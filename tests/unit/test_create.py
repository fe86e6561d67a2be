"""Ollama's create on a store (kvserve/ollama/create.py, server/create.go's rules) and a store
model's TEMPLATE/SYSTEM layers as the runner's chat template (kvserve/chat/go_chat_template.py,
kvserve.serving.chat_runner.make_template), with the tiny random GGUF; no server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.chat.go_chat_template import (
    GoChatTemplate,
    SystemChatTemplate,
    with_default_system,
)
from kvserve.chat.go_template import OllamaTemplate
from kvserve.chat.template import ChatTemplate
from kvserve.errors import InvalidInputError, NotFoundError, NotSupportedError
from kvserve.ollama.create import iter_create, iter_create_modelfile, request_file_names
from kvserve.store import Store, gguf_config

# A ChatML template in Ollama's style (qwen2.5's shape): .System, .Tools, .Messages with
# .ToolCalls and tool results, the last assistant turn left open.
GO_CHATML = (Path(__file__).resolve().parents[1] / "templates" / "chatml_tools.gotmpl").read_text()

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "models")


@pytest.fixture
def weights(store, tiny_gguf) -> str:
    """The tiny GGUF as a blob of the store (what POST /api/blobs/:digest leaves there)."""
    return store.import_file(tiny_gguf).digest


def statuses(events) -> list[str]:
    return [e["status"] for e in events]


def blobs_bytes(store: Store) -> int:
    return sum(p.stat().st_size for p in store.blobs_dir.iterdir())


# ------------------------------------------------------------------------------ files, from


def test_create_from_an_uploaded_gguf(store, weights):
    out = statuses(iter_create(store, {"model": "tiny", "files": {"tiny.gguf": weights}}))
    assert out == ["parsing GGUF", f"using existing layer {weights}", "writing manifest", "success"]
    m = store.require("tiny").manifest
    assert [(x.kind, x.digest, x.from_) for x in m.layers] == [("model", weights, "tiny.gguf")]
    cfg = json.loads(store.blob_path(m.config.digest).read_bytes())
    want = json.loads(gguf_config(store.blob_path(weights)))
    assert {k: cfg[k] for k in want} == want and cfg["model_family"] == "llama" and cfg["model_families"] == ["llama"]


def test_a_derived_model_shares_the_weights_and_costs_kilobytes(store, weights):
    list(iter_create(store, {"model": "tiny", "files": {"tiny.gguf": weights}}))
    before = blobs_bytes(store)
    body = {"model": "tiny-go", "from": "tiny", "template": GO_CHATML, "system": "You are terse.",
            "parameters": {"temperature": 0.3, "stop": ["<|im_end|>"]}, "license": ["MIT", "Apache-2.0"],
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    out = statuses(iter_create(store, body))
    d = store.require("tiny-go").manifest
    kinds = [x.kind for x in d.layers]
    assert kinds == ["model", "template", "system", "license", "license", "params", "messages"]
    assert out == [f"using existing layer {weights}", *(f"creating new layer {x.digest}" for x in d.layers[1:]),
                   "writing manifest", "success"]
    assert d.layer("model").digest == store.require("tiny").manifest.layer("model").digest == weights
    assert d.layer("model").from_ == "tiny:latest"
    shared = store.require("tiny").manifest.digests()
    assert d.config.digest in shared  # the same weights: the same config blob
    small = sum(x.size for x in d.layers if x.digest not in shared)
    assert blobs_bytes(store) - before == small < 4096  # only the small new layers
    assert store.layer_text("tiny-go", "template") == GO_CHATML
    assert store.params("tiny-go") == {"temperature": 0.3, "stop": ["<|im_end|>"]}
    assert store.messages("tiny-go") == body["messages"]
    assert store.blob_path(d.layers[1].digest).read_text() == GO_CHATML


def test_merge_rules_over_a_base(store, weights):
    """Ollama's rules: params merged (the request's keys win, a new stop replaces the list), the
    template and system replaced, licenses added, messages kept unless given; every params layer
    is re-written at the end."""
    base = {"model": "base", "files": {"tiny.gguf": weights}, "template": "{{ .Prompt }}", "system": "A",
            "license": "L1", "parameters": {"temperature": 0.2, "stop": ["a", "b"]},
            "messages": [{"role": "user", "content": "q"}]}
    list(iter_create(store, base))
    b = store.require("base").manifest
    out = statuses(iter_create(store, {"model": "kid", "from": "base", "system": "B", "license": "L2",
                                       "parameters": {"stop": ["c"], "top_k": 5}}))
    k = store.require("kid").manifest
    assert [x.kind for x in k.layers] == ["model", "template", "license", "messages", "system", "license", "params"]
    assert k.layer("template").digest == b.layer("template").digest
    assert k.layer("messages").digest == b.layer("messages").digest
    assert store.layer_text("kid", "system") == "B"
    assert [store.blob_path(x.digest).read_text() for x in k.layers_of("license")] == ["L1", "L2"]
    assert store.params("kid") == {"temperature": 0.2, "stop": ["c"], "top_k": 5}
    new = {k.layer("system").digest, k.layers_of("license")[1].digest, k.layer("params").digest}
    assert out[:-2] == [f"{'creating new' if x.digest in new else 'using existing'} layer {x.digest}"
                        for x in k.layers]
    # nothing given: the base's params are still re-written last (Ollama's setParameters)
    list(iter_create(store, {"model": "same", "from": "base", "messages": [{"role": "user", "content": "z"}]}))
    s = store.require("same").manifest
    assert [x.kind for x in s.layers] == ["model", "template", "system", "license", "params", "messages"]
    assert s.layer("params").digest == b.layer("params").digest and store.messages("same")[0]["content"] == "z"


def test_re_creating_removes_the_blobs_only_the_old_manifest_used(store, weights):
    list(iter_create(store, {"model": "tiny", "files": {"tiny.gguf": weights}}))
    list(iter_create(store, {"model": "m", "from": "tiny", "system": "one"}))
    one = store.require("m").manifest.layer("system").digest
    list(iter_create(store, {"model": "M", "from": "tiny", "system": "two"}))  # same model, another spelling
    assert [m.display for m in store.list()].count("m:latest") == 1
    assert not store.has_blob(one) and store.has_blob(weights)
    assert store.layer_text("m", "system") == "two"


def test_from_a_blob_digest_and_the_modelfile_form(store, weights):
    assert statuses(iter_create(store, {"model": "b", "from": weights}))[-1] == "success"
    assert store.require("b").manifest.layer("model").digest == weights
    out = statuses(iter_create(store, {"model": "old", "modelfile": "FROM b\nSYSTEM hi\nPARAMETER top_k 3\n"}))
    assert out[-1] == "success"
    assert store.layer_text("old", "system") == "hi" and store.params("old") == {"top_k": 3}
    with pytest.raises(InvalidInputError, match="POST /api/blobs"):
        list(iter_create(store, {"model": "old", "modelfile": "FROM ./x.gguf\n"}))


def test_a_missing_base_is_pulled_when_the_caller_can(store, weights):
    list(iter_create(store, {"model": "tiny", "files": {"tiny.gguf": weights}}))
    asked = []

    def pull(name):
        asked.append(name)
        yield {"status": "pulling manifest"}
        store.copy("tiny", name)
        yield {"status": "success"}

    out = statuses(iter_create(store, {"model": "d", "from": "other/base:v1"}, pull=pull))
    assert asked == ["other/base:v1"] and out[:2] == ["pulling manifest", "success"] and out[-1] == "success"
    with pytest.raises(NotFoundError, match="model 'nothere' not found"):
        list(iter_create(store, {"model": "d2", "from": "nothere"}))


@pytest.mark.parametrize("body, error, message", [
    ({"model": "bad name!", "from": "tiny"}, InvalidInputError, "invalid model name"),
    ({"model": "m"}, InvalidInputError, "neither 'from' or 'files' was specified"),
    ({"model": "m", "files": {"../x.gguf": "sha256:" + "0" * 64}}, InvalidInputError, "file path must be relative"),
    ({"model": "m", "files": {"/x.gguf": "sha256:" + "0" * 64}}, InvalidInputError, "file path must be relative"),
    ({"model": "m", "files": {"x.gguf": ""}}, InvalidInputError, "invalid digest format"),
    ({"model": "m", "files": {"x.gguf": "sha256:xyz"}}, InvalidInputError, "invalid digest format"),
    ({"model": "m", "files": {}}, InvalidInputError, "unknown type"),
    ({"model": "m", "files": {"x.gguf": "sha256:" + "0" * 64}}, NotFoundError, 'blob "sha256:0000'),
    ({"model": "m", "files": {"model.safetensors": "sha256:" + "0" * 64}}, NotSupportedError, "safetensors"),
    ({"model": "m", "from": "tiny", "quantize": "q4_K_M"}, NotSupportedError, "quantize is not supported yet"),
    ({"model": "m", "from": "tiny", "adapters": {"a.gguf": "sha256:" + "0" * 64}}, NotFoundError,
     'blob "sha256:0000'),
    ({"model": "m", "from": "tiny", "draft_files": {"d.gguf": "sha256:" + "0" * 64}}, NotSupportedError,
     "DRAFT is not supported yet"),
    ({"model": "m", "from": "tiny", "template": "{{ .Prompt"}, InvalidInputError, "template error: "),
    ({"model": "m", "from": "tiny", "template": "{{ call .X }}"}, InvalidInputError, "template error: "),
    ({"model": "m", "from": "tiny", "license": 3}, InvalidInputError, "cannot unmarshal number"),
    ({"model": "m", "from": "tiny", "parameters": [1]}, InvalidInputError, "cannot unmarshal array"),
    ({"model": "m", "from": "tiny", "system": 1}, InvalidInputError, "CreateRequest.system of type string"),
    ({"model": "m", "from": "bad name!"}, InvalidInputError, "invalid model name"),
])
def test_refusals_write_nothing(store, weights, body, error, message):
    list(iter_create(store, {"model": "tiny", "files": {"tiny.gguf": weights}}))
    with pytest.raises(error) as e:
        list(iter_create(store, body))
    assert message in e.value.message
    assert store.get("m") is None


def test_files_that_are_not_gguf(store, weights):
    text = store.write_blob_bytes(b'{"not": "gguf"}').digest
    with pytest.raises(InvalidInputError, match="supplied file was not in GGUF format"):
        list(iter_create(store, {"model": "m", "files": {"tiny.gguf": weights, "tokenizer.json": text}}))
    with pytest.raises(InvalidInputError, match="unknown type"):
        list(iter_create(store, {"model": "m", "files": {"tokenizer.json": text}}))
    with pytest.raises(InvalidInputError, match="not in GGUF format"):
        list(iter_create(store, {"model": "m", "from": text}))
    # a GGUF whose name does not say so is still one (Ollama sniffs the content)
    assert statuses(iter_create(store, {"model": "m", "files": {"weights": weights}}))[-1] == "success"


# ------------------------------------------------------------------------------ Modelfile


def test_create_from_a_modelfile_in_this_process(store, tiny_gguf, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    os.link(tiny_gguf, work / "w.gguf")
    text = f'FROM ./w.gguf\nTEMPLATE """{GO_CHATML}"""\nSYSTEM Be brief.\nPARAMETER num_ctx 256\n'
    out = statuses(iter_create_modelfile(store, "mf", text, work))
    m = store.require("mf").manifest
    w = m.layer("model").digest
    assert out == ["gathering model components", f"copying file {w} 100%", "parsing GGUF",
                   f"using existing layer {w}", *(f"creating new layer {x.digest}" for x in m.layers[1:]),
                   "writing manifest", "success"]
    assert os.stat(tiny_gguf).st_ino == os.stat(store.blob_path(w)).st_ino  # hard link, no copy
    assert store.layer_text("mf", "template") == GO_CHATML and store.params("mf") == {"num_ctx": 256}
    # FROM a directory: its GGUF files; a safetensors directory is refused
    assert statuses(iter_create_modelfile(store, "dir", "FROM .\n", work))[-1] == "success"
    assert store.require("dir").manifest.layer("model").digest == w
    (work / "model.safetensors").write_bytes(b"x")
    with pytest.raises(NotSupportedError, match="safetensors"):
        list(iter_create_modelfile(store, "hf", "FROM .\n", work))
    with pytest.raises(InvalidInputError, match=r"the ADAPTER file w.gguf is not a LoRA adapter"):
        list(iter_create_modelfile(store, "a", "FROM mf\nADAPTER ./w.gguf\n", work))  # a model's weights
    with pytest.raises(InvalidInputError, match="invalid model name"):
        list(iter_create_modelfile(store, "bad name!", "FROM mf\n", work))


def test_request_file_names():
    assert request_file_names(["/a/b/w.gguf"]) == {"/a/b/w.gguf": "w.gguf"}
    assert request_file_names(["/a/b/w.gguf", "/a/c/p.gguf"]) == {"/a/b/w.gguf": "b/w.gguf", "/a/c/p.gguf": "c/p.gguf"}


# ------------------------------------------------------------------------------ templates


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    from kvserve.loaders.tokenizer import Tokenizer

    return Tokenizer.from_gguf_file(tiny_gguf)


def test_go_template_renders_as_ollama_and_tokenizes_as_markup(tok):
    from kvserve.chat.prompt import render_chat

    t = GoChatTemplate(GO_CHATML, tok.bos_token, tok.eos_token, system="You are terse.")
    msgs = [{"role": "user", "content": "Hi <|im_end|> there"}]
    text, ids = render_chat(t, tok, msgs)
    want = OllamaTemplate(GO_CHATML).render([{"role": "system", "content": "You are terse."}, *msgs])
    assert text == want == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi <|im_end|> there"
                            "<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.encode("<|im_end|>", add_special=False, parse_special=True)[0]) == 2  # not the user's
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text, ids = render_chat(t, tok, plain)
    assert text.startswith("<|im_start|>system\nS<|im_end|>")  # the request's system wins
    assert ids == tok.encode(text, add_special=False, parse_special=True)


def test_go_template_tools_tool_calls_and_continuation(tok):
    from kvserve.chat.prompt import normalize_messages, render_chat

    t = GoChatTemplate(GO_CHATML)
    msgs = [{"role": "user", "content": "Read pom.xml"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "pom.xml"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "<project/>"}]
    text, _ = render_chat(t, tok, msgs, tools=[READ_FILE])
    assert '{"type":"function","function":{"name":"read_file","description":"Read a file"' in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path":"pom.xml"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n<project/>\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert t.caps["supports_tools"] and t.caps["supports_tool_calls"] and t.caps["supports_system_role"]
    assert t.caps["supports_tool_responses"] and not t.caps["requires_object_arguments"]
    # a final assistant message is continued: the render stops after its content
    text, _ = render_chat(t, tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                          continue_final_message=None)
    assert text.endswith("<|im_start|>assistant\nHel")
    assert normalize_messages(msgs)[1]["content"] is None  # render did not change the caller's messages


def test_think_values_from_the_template_variables():
    t = GoChatTemplate("{{ if .IsThinkSet }}set:{{ .Think }}:{{ .ThinkLevel }}{{ end }}{{ .Prompt }}")
    assert t.render([{"role": "user", "content": "q"}]) == "q"
    assert t.render([{"role": "user", "content": "q"}], enable_thinking=False) == "set:false:q"
    assert t.render([{"role": "user", "content": "q"}], reasoning_effort="high") == "set:true:highq"
    thinks = GoChatTemplate("{{ if .Think }}<think>{{ end }}</think>{{ .Prompt }}")
    assert thinks.render([{"role": "user", "content": "q"}]) == "<think></think>q"  # on by default


def test_default_system_for_jinja_templates(tok):
    from kvserve.chat.prompt import render_chat

    t = SystemChatTemplate("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}", system="S")
    assert render_chat(t, tok, [{"role": "user", "content": "u"}])[0] == "[system:S][user:u]"
    assert render_chat(t, tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "u"}])[0] == \
        "[system:x][user:u]"
    assert with_default_system([], "S") == [] and with_default_system([{"role": "user"}], "") == [{"role": "user"}]


def test_make_template_picks_the_template_layer(store, weights, tmp_path, caplog):
    from kvserve.serving.manager import ModelSpec
    from kvserve.serving.chat_runner import CHATML, make_template

    list(iter_create(store, {"model": "plain", "files": {"tiny.gguf": weights}}))
    list(iter_create(store, {"model": "sys", "from": "plain", "system": "S"}))
    list(iter_create(store, {"model": "go", "from": "plain", "template": GO_CHATML, "system": "S"}))
    path = str(store.blob_path(weights))
    core = SimpleNamespace(tokenizer=SimpleNamespace(bos_token="", eos_token="", chat_template=None),
                           chat_template="{{ 'gguf' }}")
    args = SimpleNamespace(models_dir=str(store.root), chat_template_file=None, chat_template=None)

    def pick(name, a=args, p=path):
        return make_template(a, core, ModelSpec(name, p))

    t = pick("go:latest")
    assert isinstance(t, GoChatTemplate) and t.source == GO_CHATML and t.system == "S"
    flags = SimpleNamespace(models_dir=str(store.root), chat_template_file=None, chat_template="chatml")
    assert isinstance(pick("go:latest", flags), GoChatTemplate)  # the model's TEMPLATE beats the flags
    assert type(pick("plain:latest")) is ChatTemplate and pick("plain:latest").source == "{{ 'gguf' }}"
    from kvserve.chat.builtin_templates import resolve_chat_template

    assert pick("plain:latest", flags).source == resolve_chat_template("chatml")[1]  # llama-server's built-in
    s = pick("sys:latest")
    assert isinstance(s, SystemChatTemplate) and s.system == "S" and s.source == "{{ 'gguf' }}"
    assert type(pick("go:latest", p=str(tmp_path / "other.gguf"))) is ChatTemplate  # other weights: not that model
    assert type(make_template(args, core, ModelSpec("/some/path.gguf", path))) is ChatTemplate
    assert type(make_template(args, core)) is ChatTemplate
    # a stored template kvserve cannot render: logged, and the model's own template is used
    bad = store.new_layer(b"{{ call .X }}", "template")
    m = store.require("go").manifest
    store.create("badgo", [m.layer("model"), bad])
    with caplog.at_level("WARNING", logger="kvserve.server"):
        t = pick("badgo:latest")
    assert type(t) is ChatTemplate and "its TEMPLATE layer is not used" in caplog.text


def test_modelfile_from_a_file_that_is_not_gguf_stores_nothing(store, tiny_gguf, tmp_path):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (work / "fake.gguf").write_bytes(b"NOTGGUF" * 10)

    def blobs() -> list[str]:
        return sorted(p.name for p in store.blobs_dir.iterdir()) if store.blobs_dir.exists() else []

    before = blobs()
    with pytest.raises(InvalidInputError, match="^unknown type$"):
        list(iter_create_modelfile(store, "x", "FROM ../../passwd\n", work))
    with pytest.raises(InvalidInputError, match="^supplied file was not in GGUF format$"):
        list(iter_create_modelfile(store, "x", "FROM ./fake.gguf\n", work))
    with pytest.raises(InvalidInputError, match="^supplied file was not in GGUF format$"):
        list(iter_create_modelfile(store, "x", "FROM .\n", work))  # a directory's .gguf files
    assert blobs() == before and store.get("x") is None
