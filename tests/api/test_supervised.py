"""Supervised engines through the server (issue 35 item 3, seed 004 Example 12): ``kvserve serve
--engine NAME=COMMAND`` starts the child on the first request, serves it through every face with
the official clients, stops it on ``keep_alive: 0``, restarts it once after a crash, and leaves
no child when kvserve is SIGKILLed. The child is tests/engine_standin.py (a stand-in: see its
docstring); the front also serves the tiny GGUF itself (``-m``) to show it stays healthy.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from servers import spawn

STANDIN = str(Path(__file__).resolve().parents[1] / "engine_standin.py")
PY = sys.executable


def _gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone between open and read: ESRCH
            return True
        time.sleep(0.05)
    return False


def _pid(text: str) -> int:
    m = re.fullmatch(r"hello from pid (\d+)", text)
    assert m, text
    return int(m.group(1))


def _wait_log(srv, needle: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while needle not in srv.log():
        assert time.monotonic() < deadline, f"{needle!r} not in the log:\n{srv.log()[-3000:]}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def front(tiny_gguf, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("supervised")
    srv = spawn(tiny_gguf, ("-a", "tiny", "-np", "1", "-c", "512",
                            "--engine", f"eng={PY} {STANDIN} --port {{port}} --loading 2",
                            "--engine", f"broken={PY} {STANDIN} --port {{port}} --exit 5",
                            "--engine", f"slow={PY} {STANDIN} --port {{port}} --never-healthy",
                            "--engine-start-timeout", "3"), logdir)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_every_face_reaches_the_child_and_keep_alive_0_stops_it(front):
    """OpenAI chat (whole and streamed), Anthropic Messages, Ollama /api/chat and OpenAI Responses all reach
    the supervised child; keep_alive 0 then stops it."""
    oai = openai.OpenAI(base_url=front.url("/v1"), api_key="x", max_retries=0)
    r = oai.chat.completions.create(model="eng", messages=[{"role": "user", "content": "hi"}])
    pid = _pid(r.choices[0].message.content)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 5)
    log = front.log()
    assert "[eng] loading model" in log and "[eng] listening" in log
    assert re.search(rf"engine 'eng': pid {pid} healthy on port \d+ in [\d.]+ s, health states \[503, 200\]", log)
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="eng", messages=[{"role": "user", "content": "hi"}], stream=True) if c.choices)
    assert streamed == f"hello from pid {pid}"
    ant = anthropic.Anthropic(base_url=front.base_url, api_key="x", max_retries=0)
    m = ant.messages.create(model="eng", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text == f"hello from pid {pid}"
    oll = ollama.Client(host=front.base_url)
    assert oll.chat(model="eng", messages=[{"role": "user", "content": "hi"}]).message.content == \
        f"hello from pid {pid}"
    assert oai.responses.create(model="eng", input="hi").output_text == f"hello from pid {pid}"  # the fourth face
    listed = {x["id"]: x for x in httpx.get(front.url("/v1/models")).json()["data"]}
    assert listed["eng"]["status"]["value"] == "loaded" and listed["eng"]["owned_by"] == "remote"
    ps = {x.model: x for x in oll.ps().models}
    assert "eng" in ps
    # keep_alive 0: the request's end unloads the model, which stops the child (checked by pid)
    assert oll.chat(model="eng", messages=[{"role": "user", "content": "bye"}], keep_alive=0).message.content == \
        f"hello from pid {pid}"
    assert _gone(pid)
    _wait_log(front, f"engine 'eng': pid {pid} exited with code 143")
    assert "[eng] received SIGTERM, shutting down" in front.log()
    assert "eng" not in {x.model for x in oll.ps().models}


def test_a_crash_restarts_the_child_once(front):
    oai = openai.OpenAI(base_url=front.url("/v1"), api_key="x", max_retries=0)
    ask = lambda: oai.chat.completions.create(model="eng", messages=[{"role": "user", "content": "hi"}])  # noqa: E731
    first = _pid(ask().choices[0].message.content)
    os.kill(first, signal.SIGKILL)
    _wait_log(front, f"engine for model 'eng' (pid {first}) exited with SIGKILL (code 137) while "
                     "serving; restarting it (once)")
    _wait_log(front, "health states [503, 200]", within=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            second = _pid(ask().choices[0].message.content)
            if second != first:
                break
        except (openai.APIStatusError, openai.APIConnectionError):
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert not _gone(second, within=0.1)
    httpx.post(front.url("/api/generate"), json={"model": "eng", "keep_alive": 0}, timeout=30)
    assert _gone(second)


def test_bounded_failures_name_the_model_and_the_cause(front):
    oai = openai.OpenAI(base_url=front.url("/v1"), api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="broken", messages=[{"role": "user", "content": "hi"}])
    assert "engine for model 'broken' exited with code 5 before it became healthy (health states []; its last " \
           "log line: cannot load model)" in e.value.message
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 15
    assert "engine for model 'slow' did not become healthy within 3 s (health states [503]; its last log line: " \
           "listening); stopped it" in e.value.message
    # the rest of kvserve is unaffected
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert httpx.get(front.url("/health")).status_code == 200


def test_sigkill_of_kvserve_leaves_no_child(tiny_gguf, tmp_path):
    srv = spawn(tiny_gguf, ("-a", "tiny", "-np", "1", "-c", "512",
                            "--engine", f"eng={PY} {STANDIN} --port {{port}} --loading 1"), tmp_path)
    try:
        srv.wait_ready()
        r = httpx.post(srv.url("/v1/chat/completions"), json={"model": "eng", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=60)
        pid = _pid(r.json()["choices"][0]["message"]["content"])
        assert not _gone(pid, within=0.1)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        assert _gone(pid, within=10)
    finally:
        srv.stop()


def test_modelfile_engine_created_here_and_served(tiny_gguf, tmp_path, monkeypatch, capsys):
    """``kvserve create NAME -f Modelfile`` with an ENGINE line writes the definition in this
    process; a server on that store serves it by name; the server's /api/create refuses ENGINE
    (a request body never starts a process)."""
    from kvserve import cli

    models = tmp_path / "models"
    work = tmp_path / "work"
    work.mkdir()
    (work / "Modelfile").write_text(f"FROM {tiny_gguf}\nENGINE {PY} {STANDIN} --port {{port}} --model {{model}}\n")
    monkeypatch.setenv("KVSERVE_HOST", "127.0.0.1:9")  # no server: create works on the store
    assert cli.main(["create", "stand", "-f", str(work / "Modelfile"), "--models-dir", str(models)]) == 0
    err = capsys.readouterr().err
    assert err.endswith(f"writing engine definition: {PY} {STANDIN} --port '{{port}}' --model '{{model}}'\nsuccess\n")
    srv = spawn("", ("--no-preload", "--models-dir", str(models), "--engine-start-timeout", "30"), tmp_path)
    try:
        srv.wait_ready()
        names = [m["name"] for m in httpx.get(srv.url("/api/tags")).json()["models"]]
        assert "stand:latest" in names
        r = httpx.post(srv.url("/api/chat"), json={"model": "stand", "stream": False, "messages": [
            {"role": "user", "content": "hi"}], "keep_alive": 0}, timeout=60)
        pid = _pid(r.json()["message"]["content"])
        assert f"[stand:latest] loading model {tiny_gguf}" in srv.log()
        assert _gone(pid)
        bad = httpx.post(srv.url("/api/create"), json={"model": "evil", "modelfile": (
            f"FROM {tiny_gguf}\nENGINE touch /tmp/pwned --port {{port}}\n")}, timeout=30)
        assert bad.status_code == 400 and "command must be one of" in bad.json()["error"]
        assert httpx.post(srv.url("/api/chat"), json={"model": "evil", "messages": []}).status_code == 404
        assert cli.main(["rm", "stand", "--models-dir", str(models)]) == 0
        assert capsys.readouterr().out == "deleted 'stand'\n"
    finally:
        srv.stop()
