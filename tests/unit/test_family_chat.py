"""Each model family's chat through the OpenAI, Ollama and Anthropic faces (issue 30, Build 2: "Each
family's chat template, tool-call format and reasoning format work through every face").

A tiny random model of each family (tests/family_oracle.py's cases) is written as a GGUF carrying the
family's released chat template (tests/templates/vendor/) and served in-process with llama-server's
defaults (no reasoning or tool flags): the format is found from the template, as llama-server finds
it. The sampled tokens are forced to an answer in the family's own format (the logits of each step
masked to the next token of a script, then sampled by the real chain, grammar masks included), so
each face's parsing of the reasoning and of a tool call is checked on what the engine emits:

* qwen3 / qwen3moe: ``<think>`` reasoning (llama-server's ``--reasoning-format auto``: the text up
  to ``</think>`` unstripped, seed 000 Example 14), Hermes ``<tool_call>`` JSON (Qwen3's template);
* llama3: Llama 3.2's template, a bare JSON call ``{"name", "parameters"}``;
* mistral3: Mistral Small 3.2's template, ``[TOOL_CALLS]name[ARGS]{...}``;
* gemma2 / gemma3 and phi3: templates that render no tools (and gemma's, no system role), so tools
  take llama-server's generic format: a JSON object constrained from the first token.

gpt-oss (Harmony) has its own file: tests/unit/test_gpt_oss_chat.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
import family_oracle  # noqa: E402
from kvserve.app import build_app  # noqa: E402
from kvserve.serving.args import parse_args  # noqa: E402
from kvserve.serving.state import ServerState  # noqa: E402

VENDOR = Path(__file__).resolve().parents[1] / "templates" / "vendor"
READ_FILE = {"name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
USER = [{"role": "user", "content": "2+2?"}]
ASK = [{"role": "user", "content": "Show me pom.xml"}]
#: the generic format's answer with parallel_tool_calls (every face's default): a list of calls
GENERIC_CALL = '{"tool_calls": [{"name": "read_file", "arguments": {"path": "pom.xml"}}]}'
#: case -> (template file, a plain answer, its (reasoning, content), a call of read_file(path=pom.xml))
FORMATS = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "<think>\nEasy sum.\n</think>\n\nIt is 4.", ("\nEasy sum.\n", "It is 4."),
              '<think>\nI need the file.\n</think>\n\n<tool_call>\n{"name": "read_file", "arguments": '
              '{"path": "pom.xml"}}\n</tool_call>'),
    "qwen3moe": ("Qwen-Qwen3-0.6B.jinja", "<think>\nEasy sum.\n</think>\n\nIt is 4.", ("\nEasy sum.\n", "It is 4."),
                 '<think>\nI need the file.\n</think>\n\n<tool_call>\n{"name": "read_file", "arguments": '
                 '{"path": "pom.xml"}}\n</tool_call>'),
    "llama3-rope": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "It is 4.", (None, "It is 4."),
                    '{"name": "read_file", "parameters": {"path": "pom.xml"}}'),
    "mistral3": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "It is 4.", (None, "It is 4."),
                 '[TOOL_CALLS]read_file[ARGS]{"path": "pom.xml"}'),
    "gemma2": ("google-gemma-2-2b-it.jinja", "It is 4.", (None, "It is 4."), GENERIC_CALL),
    "gemma3": ("google-gemma-2-2b-it.jinja", "It is 4.", (None, "It is 4."), GENERIC_CALL),
    "phi3-longrope": ("microsoft-Phi-3.5-mini-instruct.jinja", "It is 4.", (None, "It is 4."), GENERIC_CALL),
}
CASES = list(FORMATS)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """case -> a tiny GGUF of the family with the family's chat template."""
    tmp = tmp_path_factory.mktemp("family-chat")
    out = {}
    for case, (template, *_) in FORMATS.items():
        arch = family_oracle.CASES[case][1]
        out[case] = str(fmod.save_gguf(family_oracle.build_model(case), tmp / f"{case}.gguf", arch,
                                       chat_template=(VENDOR / template).read_text()))
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The app in-process, no model at start: each request names its file (``--allow-model-paths``)."""
    args = parse_args(["--no-preload", "--allow-model-paths", "--models-dir", str(tmp_path_factory.mktemp("models")),
                       "-c", "4096", "-np", "1", "--max-loaded-models", "1"])
    with TestClient(build_app(ServerState(args)), base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture
def forced(monkeypatch):
    """``forced(text)``: every request's generated tokens spell ``text`` (the tiny vocabulary all
    families here share), then end of generation (id 0)."""
    from kvserve.engine import model_runner as runner_mod
    from kvserve.models.build import load_files

    real = runner_mod.sample_batch
    script: list[int] = []

    def sample_batch(logits, samplers, histories, num_generated, masks, *a, **kw):
        logits = logits.clone()
        for i, n in enumerate(num_generated):
            row = torch.full_like(logits[i], float("-inf"))
            row[script[n] if n < len(script) else 0] = 0.0
            logits[i] = row
        return real(logits, samplers, histories, num_generated, masks, *a, **kw)

    monkeypatch.setattr(runner_mod, "sample_batch", sample_batch)
    tok = {}

    def set_text(path: str, text: str) -> None:
        if "t" not in tok:
            tok["t"] = load_files(path).tokenizer
        script[:] = tok["t"].encode(text)

    return set_text


def _openai_tool() -> dict:
    return {"type": "function", "function": READ_FILE}


@pytest.mark.parametrize("case", CASES)
def test_openai_face(client, files, forced, case):
    _, plain, (reasoning, content), call = FORMATS[case]
    model = files[case]
    forced(model, plain)
    ch = client.post("/v1/chat/completions", json={"model": model, "messages": USER, "max_tokens": 400}).json()
    ch = ch["choices"][0]
    assert (ch["message"].get("reasoning_content"), ch["message"]["content"], ch["finish_reason"]) == \
        (reasoning, content, "stop")
    text, thought = "", ""
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": model, "messages": USER, "max_tokens": 400, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    thought += c["delta"].get("reasoning_content") or ""
    assert (thought or None, text) == (reasoning, content)
    forced(model, call)
    ch = client.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 400,
                                                   "tools": [_openai_tool()]}).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and not ch["message"]["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ch["message"]["tool_calls"]] == \
        [("read_file", {"path": "pom.xml"})]


@pytest.mark.parametrize("case", CASES)
def test_ollama_face(client, files, forced, case):
    _, plain, (reasoning, content), call = FORMATS[case]
    model = files[case]
    caps = set(client.post("/api/show", json={"model": model}).json()["capabilities"])
    # Ollama's rule: "tools" when the template renders tools (the generic format works all the same)
    assert "completion" in caps and ("tools" in caps) == (call != GENERIC_CALL)
    assert ("thinking" in caps) == (reasoning is not None)
    forced(model, plain)
    m = client.post("/api/chat", json={"model": model, "messages": USER, "stream": False}).json()["message"]
    assert (m.get("thinking") or None, m["content"]) == (reasoning, content)
    forced(model, call)
    m = client.post("/api/chat", json={"model": model, "messages": ASK, "stream": False,
                                       "tools": [_openai_tool()]}).json()["message"]
    assert not m["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == \
        [("read_file", {"path": "pom.xml"})]


@pytest.mark.parametrize("case", CASES)
def test_anthropic_face(client, files, forced, case):
    _, plain, (reasoning, content), call = FORMATS[case]
    model = files[case]
    forced(model, plain)
    r = client.post("/v1/messages", json={"model": model, "max_tokens": 400, "messages": USER}).json()
    want = ([("thinking", reasoning)] if reasoning else []) + [("text", content)]
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in r["content"]] == want
    assert r["stop_reason"] == "end_turn"
    forced(model, call)
    tool = {"name": "read_file", "description": "Read a file", "input_schema": READ_FILE["parameters"]}
    r = client.post("/v1/messages", json={"model": model, "max_tokens": 400, "tools": [tool], "messages": ASK}).json()
    uses = [b for b in r["content"] if b["type"] == "tool_use"]
    assert r["stop_reason"] == "tool_use" and [(b["name"], b["input"]) for b in uses] == [("read_file", {"path": "pom.xml"})]
    assert not [b for b in r["content"] if b["type"] == "text" and b["text"]]


def test_system_message_merged_for_templates_without_the_system_role(files, caplog):
    """llama-server's workaround (common/chat.cpp system_message_not_supported), exactly."""
    from kvserve.chat.prompt import merge_system_message, render_chat
    from kvserve.chat.template import ChatTemplate

    sys_msg = {"role": "system", "content": "Be brief."}
    assert merge_system_message([sys_msg, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]) \
        == [{"role": "user", "content": "Be brief.\nHi"}, {"role": "assistant", "content": "Yo"}]
    parts = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi"}]
    assert merge_system_message([sys_msg, {"role": "user", "content": parts}]) == \
        [{"role": "user", "content": [parts[0], {"type": "text", "text": "Be brief.\nHi"}]}]
    assert merge_system_message([{"role": "user", "content": "Hi"}]) == [{"role": "user", "content": "Hi"}]
    with caplog.at_level("WARNING"):
        assert merge_system_message([sys_msg]) == []
    assert "does not support the system role" in caplog.text
    gemma = ChatTemplate((VENDOR / "google-gemma-2-2b-it.jinja").read_text(), "<bos>", "<eos>")
    assert gemma.caps["supports_system_role"] is False

    from kvserve.models.build import load_files

    text, _ = render_chat(gemma, load_files(files["gemma2"]).tokenizer, [sys_msg, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n"
