"""vLLM's LoRA interface (issue 34, item 3): ``--enable-lora``, ``--lora-modules`` (``name=path`` and
JSON), ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``; each adapter a model name in
``/v1/models`` (``parent``: the base, ``root``: the adapter's path) chosen by ``model`` in every face;
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
with vLLM's texts and codes.

The reference for an adapter's tokens is the base model with that adapter merged by hand in float32
(``tinylora.write_merged_hf_dir``: W + scale * B @ A), served in process. The base is the tiny HF
model (float32), the adapters tiny random ones (a PEFT directory and a llama.cpp LoRA GGUF). One real
server process (the official ``openai``, ``anthropic`` and ``ollama`` clients talk to it), the
other cases in process (Starlette's TestClient)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import tinylora  # tests/ is on sys.path (tests/conftest.py)
import tinymodel
from servers import app_client, spawn

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PROMPT = "hello world"
ASK = [{"role": "user", "content": "Name a color."}]
ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base, the adapters (seed 1: PEFT, seed 2: GGUF, rank 32, another base's) and the merges."""
    d = tmp_path_factory.mktemp("lora_vllm")
    f = {
        "dir": d,
        "base": tinymodel.write_tiny_hf_dir(d / "base"),
        "peft": tinylora.write_peft_adapter(d / "peft", seed=1),
        "gguf": tinylora.write_gguf_adapter(d / "gg.gguf", seed=2),
        "rank32": tinylora.write_peft_adapter(d / "rank32", seed=3, rank=32),
        "other": tinylora.write_gguf_adapter(d / "other.gguf", seed=4, n_ff=96),
        "m_peft": tinylora.write_merged_hf_dir(d / "m_peft", [(dict(seed=1), 1.0)]),
        "m_gguf": tinylora.write_merged_hf_dir(d / "m_gguf", [(dict(seed=2), 1.0)]),
    }
    return f


def _tokens(client, model: str, prompt: str = PROMPT, n: int = 10) -> list[int]:
    """Greedy completion token ids through the official client (vLLM's return_tokens_as_token_ids)."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


@pytest.fixture(scope="module")
def reference(files):
    """What each merged model answers (in process): completion ids, chat text."""
    out = {}
    for key in ("m_peft", "m_gguf", "base"):
        (files["dir"] / f"ref_{key}").mkdir(exist_ok=True)
        c = app_client(files[key], files["dir"] / f"ref_{key}")
        try:
            client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=c, max_retries=0)
            chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
            out[key] = {"ids": _tokens(client, "tiny"), "chat": chat.choices[0].message.content}
        finally:
            c.portal.call(c.state.manager.shutdown)
            c.__exit__(None, None, None)
    assert out["m_peft"]["ids"] != out["base"]["ids"] and out["m_gguf"]["ids"] != out["base"]["ids"]
    return out


@pytest.fixture(scope="module")
def srv(files, tmp_path_factory):
    """``kvserve serve -m base -a tiny --lora-modules sql=PEFT {gg JSON}`` with runtime updates on."""
    gg = json.dumps({"name": "gg", "path": str(files["gguf"]), "base_model_name": "tiny"})
    home = tmp_path_factory.mktemp("lora_home")
    s = spawn(str(files["base"]), ("-a", "tiny", "-c", "1024", "-np", "2", "--lora-modules", f"sql={files['peft']}",
                                   gg, "--max-loras", "2", "--max-cpu-loras", "2"),
              tmp_path_factory.mktemp("lora_logs"), {**ENV, "KVSERVE_HOME": str(home)})
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)


def test_models_list_parent_and_root(srv, client, files):
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "gg"]
    data = {m["id"]: m for m in httpx.get(srv.url("/v1/models")).json()["data"]}
    assert (data["sql"]["parent"], data["sql"]["root"], data["sql"]["object"]) == ("tiny", str(files["peft"]), "model")
    assert (data["gg"]["parent"], data["gg"]["root"]) == ("tiny", str(files["gguf"]))
    assert data["tiny"]["parent"] is None
    one = httpx.get(srv.url("/v1/models/sql")).json()
    assert (one["id"], one["parent"], one["root"]) == ("sql", "tiny", str(files["peft"]))
    shown = httpx.post(srv.url("/api/show"), json={"model": "sql"}, timeout=60).json()["modelfile"]
    assert f"\nADAPTER {files['peft']}\n" in shown  # Ollama's show: the adapter after FROM


def test_openai_client_adapter_tokens_equal_merged(client, reference):
    assert _tokens(client, "sql") == reference["m_peft"]["ids"]
    assert _tokens(client, "gg") == reference["m_gguf"]["ids"]
    assert _tokens(client, "tiny") == reference["base"]["ids"]  # the base is untouched by loaded adapters
    r = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.model == "sql"  # vLLM answers with the adapter's name


def test_every_face_applies_the_adapter(srv, client, reference):
    want = reference["m_peft"]["chat"]
    chat = client.chat.completions.create(model="sql", messages=ASK, max_tokens=8, temperature=0)
    assert (chat.model, chat.choices[0].message.content) == ("sql", want)
    r = httpx.post(srv.url("/v1/responses"), json={"model": "sql", "input": ASK, "max_output_tokens": 8,
                                                   "temperature": 0}, timeout=120).json()
    assert r["output"][-1]["content"][0]["text"] == want
    r = httpx.post(srv.url("/v1/messages"), json={"model": "sql", "messages": ASK, "max_tokens": 8,
                                                  "temperature": 0}, timeout=120).json()
    assert (r["model"], r["content"][0]["text"]) == ("sql", want)
    ollama = pytest.importorskip("ollama")
    r = ollama.Client(host=srv.base_url).chat(model="sql", messages=ASK, options={"num_predict": 8, "temperature": 0})
    assert r.message.content == want
    assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                          temperature=0).choices[0].message.content == reference["base"]["chat"]


def _load(srv, body) -> httpx.Response:
    return httpx.post(srv.url("/v1/load_lora_adapter"), json=body, timeout=120)


def _unload(srv, body) -> httpx.Response:
    return httpx.post(srv.url("/v1/unload_lora_adapter"), json=body, timeout=120)


def _err(r: httpx.Response) -> tuple[int, str, str]:
    e = r.json()["error"]
    assert e["code"] == r.status_code
    return r.status_code, e["type"], e["message"]


def test_runtime_load_and_unload(srv, client, files, reference):
    r = _load(srv, {"lora_name": "rt", "lora_path": str(files["gguf"])})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'rt' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "gg", "rt"]
    assert _tokens(client, "rt") == reference["m_gguf"]["ids"]
    assert _err(_load(srv, {"lora_name": "rt", "lora_path": str(files["peft"])})) == (
        400, "InvalidUserInput", "The lora adapter 'rt' has already been loaded. If you want to load the adapter in "
                                 "place, set 'load_inplace' to True.")
    r = _load(srv, {"lora_name": "rt", "lora_path": str(files["peft"]), "load_inplace": True})
    assert r.status_code == 200
    assert _tokens(client, "rt") == reference["m_peft"]["ids"]  # in place: the new weights answer
    r = _unload(srv, {"lora_name": "rt"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'rt' removed successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "gg"]
    assert _err(_unload(srv, {"lora_name": "rt"})) == (404, "NotFoundError", "The lora adapter 'rt' cannot be found.")
    assert _tokens(client, "sql") == reference["m_peft"]["ids"]


def test_runtime_load_bad_input(srv, client, files, reference):
    both = (400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
    assert _err(_load(srv, {"lora_name": "x"})) == both
    assert _err(_load(srv, {"lora_path": str(files["gguf"])})) == both
    assert _err(_unload(srv, {})) == (400, "InvalidUserInput",
                                      "'lora_name' needs to be provided to unload a LoRA adapter.")
    missing = str(files["dir"] / "nope")
    assert _err(_load(srv, {"lora_name": "m", "lora_path": missing})) == (
        404, "NotFoundError", f"Loading lora m failed: No adapter found for {missing}")
    assert _err(_load(srv, {"lora_name": "big", "lora_path": str(files["rank32"])})) == (
        400, "BadRequestError", "LoRA rank 32 is greater than max_lora_rank 16.")
    code, kind, text = _err(_load(srv, {"lora_name": "oth", "lora_path": str(files["other"])}))
    assert (code, kind) == (400, "BadRequestError") and "blk.0.ffn_" in text and "another base model" in text
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "gg"]  # nothing half-added
    assert _tokens(client, "sql") == reference["m_peft"]["ids"]  # other requests go on


def test_unknown_adapter_name_in_each_dialect(files, tmp_path):
    """No ``-m`` (several models): an unknown name is a 404 in each face's envelope; the adapter's
    base named by its path (``--allow-model-paths``)."""
    from starlette.testclient import TestClient

    from kvserve.app import build_app
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    module = json.dumps({"name": "sql", "path": str(files["peft"]), "base_model_name": str(files["base"])})
    state = ServerState(parse_args(["--no-preload", "-c", "512", "-np", "1", "--allow-model-paths",
                                    "--models-dir", str(tmp_path / "models"), "--lora-modules", module]))
    with TestClient(build_app(state), base_url="http://127.0.0.1") as c:
        try:
            data = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert (data["sql"]["parent"], data["sql"]["root"]) == (str(files["base"]), str(files["peft"]))
            r = c.post("/v1/chat/completions", json={"model": "nope", "messages": ASK, "max_tokens": 2})
            assert (r.status_code, r.json()["error"]["message"]) == (404, "model 'nope' not found")
            r = c.post("/v1/messages", json={"model": "nope", "messages": ASK, "max_tokens": 2})
            assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (404, "error", "not_found_error")
            r = c.post("/api/chat", json={"model": "nope", "messages": ASK, "stream": False})
            assert (r.status_code, r.json()) == (404, {"error": "model 'nope' not found"})
            r = c.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
            assert (r.status_code, r.json()["model"]) == (200, "sql")
            # the env var is not set: vLLM's runtime routes do not exist
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(files["gguf"])})
            assert r.status_code == 404
        finally:
            c.portal.call(state.manager.shutdown)


def test_static_adapter_above_max_rank_stops_the_server(files, tmp_path):
    """vLLM's init_static_loras: a ``--lora-modules`` adapter that does not load stops the start-up."""
    from kvserve.errors import InvalidInputError
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["-m", str(files["base"]), "-c", "512", "-np", "1", "--models-dir",
                                    str(tmp_path / "models"), "--lora-modules", f"big={files['rank32']}"]))

    async def start():
        try:
            await state.preload()
        finally:
            await state.manager.shutdown()

    with pytest.raises(InvalidInputError, match=r"^LoRA rank 32 is greater than max_lora_rank 16\.$"):
        asyncio.run(start())


@pytest.mark.parametrize("cpu_loras", [1, 2])
def test_max_loras_queues_and_max_cpu_loras_evicts(files, reference, cpu_loras):
    """``--max-loras 1``: requests for two adapters at once both finish with their own tokens (vLLM
    queues, never refuses): with ``--max-cpu-loras 1`` one waits for the other's adapter to be
    evicted, with 2 both are in memory and the engine's steps hold one adapter each. The adapter
    memory counted in the model's size follows what is loaded."""
    gg = json.dumps({"name": "gg", "path": str(files["gguf"]), "base_model_name": "tiny"})
    (files["dir"] / f"q{cpu_loras}").mkdir(exist_ok=True)
    c = app_client(files["base"], files["dir"] / f"q{cpu_loras}", "--lora-modules", f"sql={files['peft']}", gg,
                   "--max-loras", "1", "--max-cpu-loras", str(cpu_loras))
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=c, max_retries=0)
        entry = c.state.manager.loaded["tiny"]
        reg = entry.runner.lora
        kept = ["gg"] if cpu_loras == 1 else ["sql", "gg"]
        assert [e.name for e in reg.entries()] == kept  # both checked at start-up, the last ones kept
        plain = entry.size - reg.nbytes
        assert _tokens(client, "sql") == reference["m_peft"]["ids"]
        kept = ["sql"] if cpu_loras == 1 else ["sql", "gg"]
        assert [e.name for e in reg.entries()] == kept and entry.size == plain + reg.nbytes and reg.nbytes > 0
        results: dict[str, list[int]] = {}

        def ask(model: str) -> None:
            results[model] = _tokens(client, model, n=24)

        threads = [threading.Thread(target=ask, args=(m,)) for m in ("sql", "gg", "sql", "gg")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results["sql"][:10] == reference["m_peft"]["ids"] and results["gg"][:10] == reference["m_gguf"]["ids"]
        assert len(reg) == cpu_loras and entry.size == plain + reg.nbytes  # at most --max-cpu-loras in memory
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)
