"""kvserve's Ollama commands against a real ``kvserve serve`` (its /api face) on a free loopback
port, with the tiny random model: the server path prints what the store path prints, and ps,
stop and run go through the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve import cli
from kvserve.ollama.local import LocalApi
from kvserve.store import Store
from kvserve.store.blobs import sha256_file

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_gguf):
    """A server on the store ``$KVSERVE_HOME/models`` holding ``tiny:latest``; yields (url, home)."""
    home = tmp_path_factory.mktemp("clihome")
    store = Store(home / "models")
    api = LocalApi(store)
    digest = f"sha256:{sha256_file(tiny_gguf)}"
    api.upload_blob(tiny_gguf, digest)
    assert list(api.create({"model": "tiny", "files": {"tiny.gguf": digest}}))[-1] == {"status": "success"}
    port = _free_port()
    log = home / "server.log"
    env = dict(os.environ, KVSERVE_HOME=str(home), PYTHONUNBUFFERED="1")
    env.pop("OLLAMA_MODELS", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--no-preload", "--host", "127.0.0.1",
                                 "--port", str(port), "-c", "1024", "-np", "1"], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server not ready:\n" + log.read_text(errors="replace"))
            time.sleep(0.1)
        if httpx.get(url + "/api/tags", timeout=10).status_code == 404:
            pytest.skip("this server has no Ollama /api face")
        yield url, home
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def env(served, monkeypatch):
    url, home = served
    monkeypatch.setenv("KVSERVE_HOST", url.removeprefix("http://"))
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("KVSERVE_HOME", str(home))
    now = time.time()
    monkeypatch.setattr(cli, "clock", lambda: now)
    return Store(home / "models")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def test_the_commands_use_the_server(env, monkeypatch):
    seen = []
    real = cli._server

    def spy():
        api = real()
        seen.append(api)
        return api

    monkeypatch.setattr(cli, "_server", spy)
    assert cli.main(["list"]) == 0
    assert seen and seen[0] is not None and cli._is_server(seen[0])


def test_list_and_show_print_what_the_store_prints(env, capsys):
    store_dir = str(env.root)
    for argv in (["list"], ["show", "tiny"], ["show", "tiny", "--modelfile"], ["show", "tiny", "--template"],
                 ["show", "tiny", "--parameters"], ["show", "nothere"]):
        assert run(capsys, *argv) == run(capsys, *argv, "--models-dir", store_dir), argv
    assert run(capsys, "show", "nothere")[2] == "Error: model 'nothere' not found\n"


def test_run_then_ps_then_stop(env, capsys, monkeypatch):
    monkeypatch.setattr(cli, "clock", time.time)
    rc, served_text, err = run(capsys, "run", "tiny", "Hello", "-n", "5", "--temp", "0")
    assert rc == 0, err
    rc, out, _ = run(capsys, "ps")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2
    assert re.fullmatch(r"NAME +ID +SIZE +PROCESSOR +CONTEXT +UNTIL +", lines[0])
    digest = env.require("tiny").digest[:12]
    assert re.fullmatch(rf"tiny:latest    {digest}    \d+ MB    100% CPU     1024       4 minutes from now    ",
                        lines[1]), lines[1]
    assert run(capsys, "stop", "tiny") == (0, "", "")
    assert run(capsys, "ps")[1] == "NAME    ID    SIZE    PROCESSOR    CONTEXT    UNTIL \n"
    assert run(capsys, "stop", "nothere") == (1, "", "Error: couldn't find model \"nothere\" to stop\n")
    # greedy through the server and in this process: the same text
    in_process = cli._run_here(cli._run_args(["tiny", "Hello", "-n", "5", "--temp", "0"]))
    assert in_process == 0
    assert capsys.readouterr().out == served_text


def test_cp_rm_and_create_through_the_server(env, tmp_path, capsys):
    assert run(capsys, "cp", "tiny", "tiny-copy") == (0, "copied 'tiny' to 'tiny-copy'\n", "")
    assert env.require("tiny-copy").digest == env.require("tiny").digest
    assert run(capsys, "rm", "tiny-copy") == (0, "deleted 'tiny-copy'\n", "")
    assert env.get("tiny-copy") is None
    mf = tmp_path / "Modelfile"
    mf.write_text("FROM tiny\nSYSTEM Be brief.\n")
    rc, out, err = run(capsys, "create", "brief", "-f", str(mf))
    assert (rc, out) == (0, ""), err
    lines = [ln for ln in err.splitlines() if not ln.startswith("note: ")]
    assert lines[0] == "gathering model components" and lines[-2:] == ["writing manifest", "success"]
    brief = env.require("brief")
    assert brief.manifest.layer("model").digest == env.require("tiny").manifest.layer("model").digest
    assert run(capsys, "show", "brief", "--system")[1] == "Be brief."
    assert run(capsys, "rm", "brief") == (0, "deleted 'brief'\n", "")


def test_push_and_pull_through_the_server(env, tmp_path, capsys):
    import ociregistry

    if ociregistry.registry_binary() is None:
        pytest.skip(ociregistry.MISSING)
    with ociregistry.running_registry(tmp_path / "registry") as reg:
        name = reg.name("cli/tiny:latest")
        assert run(capsys, "cp", "tiny", name)[0] == 0
        weights = env.require(name).manifest.layer("model")
        rc, _, err = run(capsys, "push", name, "--insecure")
        assert rc == 0, err
        assert f"pushing {weights.digest[7:19]}" in err and err.rstrip().endswith("success")
        assert "note:" not in err  # the server pushed, not this process
        assert run(capsys, "rm", name) == (0, f"deleted '{name}'\n", "")
        rc, _, err = run(capsys, "pull", name, "--insecure")
        assert rc == 0, err
        lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
        assert lines[0] == "pulling manifest" and lines[-1] == "success" and "note:" not in err
        assert any(ln.startswith(f"pulling {weights.digest[7:19]}: 100%") for ln in lines)
        assert env.require(name).manifest.layer("model").digest == weights.digest
        rc, _, err = run(capsys, "pull", reg.name("cli/absent"), "--insecure")
        assert (rc, err.splitlines()[-1]) == (1, "Error: pull model manifest: file does not exist")
        assert run(capsys, "rm", name)[0] == 0


def test_create_from_a_gguf_uploads_its_blob_to_the_server(env, tmp_path, capsys):
    import tinymodel

    gguf = tinymodel.write_tiny_gguf(tmp_path / "other.gguf", seed=7)
    digest = f"sha256:{sha256_file(gguf)}"
    assert not env.has_blob(digest)
    (tmp_path / "Modelfile").write_text("FROM ./other.gguf\nPARAMETER num_ctx 256\n")
    rc, out, err = run(capsys, "create", "other", "-f", str(tmp_path / "Modelfile"))
    assert (rc, out) == (0, ""), err
    lines = [ln for ln in err.splitlines() if not ln.startswith("note: ")]
    assert lines[:2] == ["gathering model components", f"copying file {digest} 0%"]
    assert f"copying file {digest} 100%" in lines and lines[-1] == "success"
    assert env.has_blob(digest)  # POST /api/blobs/:digest put it in the server's store
    assert env.require("other").manifest.layer("model").digest == digest
    assert env.params("other") == {"num_ctx": 256}
    assert run(capsys, "rm", "other") == (0, "deleted 'other'\n", "")
    assert not env.has_blob(digest)
