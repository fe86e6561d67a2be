"""gpt-oss chat through the OpenAI, Ollama and Anthropic faces: a tiny gpt-oss GGUF carrying the
released harmony template (tests/templates/vendor/openai-gpt-oss-120b.jinja), served in-process with no
reasoning or tool flags (llama-server's defaults). The model's sampled tokens are forced to a harmony
answer (the logits each step are masked to the next token of a script, then sampled by the real
chain), so each face's parsing of the analysis channel (reasoning) and of a commentary-channel call
is checked on what the engine really emits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
from kvserve.app import build_app  # noqa: E402
from kvserve.serving.args import parse_args  # noqa: E402
from kvserve.serving.state import ServerState  # noqa: E402

TEMPLATE = (Path(__file__).resolve().parents[1] / "templates" / "vendor" / "openai-gpt-oss-120b.jinja").read_text()
CALL = ("<|channel|>analysis<|message|>I need the file.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.read_file <|constrain|>json<|message|>{"path":"pom.xml"}<|call|>')
FINAL = "<|channel|>analysis<|message|>Easy sum.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
READ_FILE = {"name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    model = fmod.build("gpt_oss", seed=3, num_hidden_layers=2, sliding_window=4, num_local_experts=4,
                       num_experts_per_tok=2, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                               "original_max_position_embeddings": 128})
    return str(fmod.save_gguf(model, tmp_path_factory.mktemp("gptoss") / "m.gguf", "gpt-oss", chat_template=TEMPLATE))


@pytest.fixture(scope="module")
def client(gguf_path, tmp_path_factory):
    """The app in-process, no model at start: each request names the file (``--allow-model-paths``)."""
    args = parse_args(["--no-preload", "--allow-model-paths", "--models-dir", str(tmp_path_factory.mktemp("models")),
                       "-c", "1024", "-np", "1"])
    with TestClient(build_app(ServerState(args)), base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture
def forced(client, monkeypatch):
    """``forced(text)``: every request's generated tokens spell ``text`` (the served model's own
    tokens), then end of generation."""
    from kvserve.engine import model_runner as runner_mod

    real = runner_mod.sample_batch
    script: list[int] = []

    def sample_batch(logits, samplers, histories, num_generated, masks, *a, **kw):
        logits = logits.clone()
        for i, n in enumerate(num_generated):
            tok = script[n] if n < len(script) else eog
            row = torch.full_like(logits[i], float("-inf"))
            row[tok] = 0.0
            logits[i] = row
        return real(logits, samplers, histories, num_generated, masks, *a, **kw)

    monkeypatch.setattr(runner_mod, "sample_batch", sample_batch)
    eog = 0  # the tiny vocabulary's end-of-generation token

    def set_text(text: str) -> None:
        script[:] = _TOKENIZER["t"].encode(text)

    return set_text


_TOKENIZER: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _tok(gguf_path):
    from kvserve.models.build import load_files

    _TOKENIZER["t"] = load_files(gguf_path).tokenizer


def test_the_file_template_renders_harmony(client, gguf_path):
    r = client.post("/apply-template", json={"model": gguf_path, "messages": USER})
    prompt = r.json()["prompt"]
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT")
    assert prompt.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")


def test_openai_face_reasoning_and_final(client, gguf_path, forced):
    forced(FINAL)
    msg = client.post("/v1/chat/completions", json={"model": gguf_path, "messages": USER, "max_tokens": 200}).json()["choices"][0]
    assert (msg["message"]["reasoning_content"], msg["message"]["content"], msg["finish_reason"]) == \
        ("Easy sum.", "It is 4.", "stop")
    text, reasoning = "", ""
    with client.stream("POST", "/v1/chat/completions", json={"model": gguf_path, "messages": USER, "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
                    reasoning += ch["delta"].get("reasoning_content") or ""
    assert (reasoning, text) == ("Easy sum.", "It is 4.")


def test_openai_face_tool_call(client, gguf_path, forced):
    forced(CALL)
    body = {"model": gguf_path, "messages": [{"role": "user", "content": "Show me pom.xml"}], "max_tokens": 200,
            "tools": [{"type": "function", "function": READ_FILE}]}
    ch = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["reasoning_content"] == "I need the file."
    assert not ch["message"]["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ch["message"]["tool_calls"]] == \
        [("read_file", {"path": "pom.xml"})]


def test_ollama_face_thinking_and_tool_call(client, gguf_path, forced):
    show = client.post("/api/show", json={"model": gguf_path}).json()
    assert {"completion", "thinking", "tools"} <= set(show["capabilities"])
    forced(FINAL)
    m = client.post("/api/chat", json={"model": gguf_path, "messages": USER, "stream": False}).json()["message"]
    assert (m["thinking"], m["content"]) == ("Easy sum.", "It is 4.")
    m = client.post("/api/chat", json={"model": gguf_path, "messages": USER, "stream": False, "think": "low"}).json()
    assert (m["message"]["thinking"], m["message"]["content"]) == ("Easy sum.", "It is 4.")
    forced(CALL)
    body = {"model": gguf_path, "messages": [{"role": "user", "content": "Show me pom.xml"}], "stream": False,
            "tools": [{"type": "function", "function": READ_FILE}]}
    m = client.post("/api/chat", json=body).json()["message"]
    assert m["thinking"] == "I need the file." and not m["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == \
        [("read_file", {"path": "pom.xml"})]


def test_anthropic_face_thinking_and_tool_use(client, gguf_path, forced):
    forced(FINAL)
    r = client.post("/v1/messages", json={"model": gguf_path, "max_tokens": 200, "messages": USER}).json()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in r["content"]] == \
        [("thinking", "Easy sum."), ("text", "It is 4.")]
    assert r["stop_reason"] == "end_turn"
    forced(CALL)
    tool = {"name": "read_file", "description": "Read a file", "input_schema": READ_FILE["parameters"]}
    r = client.post("/v1/messages", json={"model": gguf_path, "max_tokens": 200, "tools": [tool],
                                          "messages": [{"role": "user", "content": "Show me pom.xml"}]}).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "tool_use"] and r["stop_reason"] == "tool_use"
    assert (r["content"][1]["name"], r["content"][1]["input"]) == ("read_file", {"path": "pom.xml"})
