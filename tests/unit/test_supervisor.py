"""Supervised engines (kvserve.supervisor): the child's start, health transitions, log, stop,
restart once, and the bounded failures, with the stand-in engine of tests/engine_standin.py
playing the child (real engines cannot run in CI; see its docstring)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvserve.errors import InvalidInputError, ServerFaultError
from kvserve.supervisor import EngineChild, EngineSpec, EngineStartError, parse_engine

STANDIN = str(Path(__file__).resolve().parents[1] / "engine_standin.py")


def spec(*extra: str, timeout: float = 30.0, name: str = "m") -> EngineSpec:
    return EngineSpec(name, (sys.executable, STANDIN, "--port", "{port}", *extra), start_timeout_s=timeout)


def gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie nobody reaps)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvserve.server"]


def test_parse_engine():
    e = parse_engine("smol=llama-server -m '/models/a b.gguf' --host {host} --port {port}")
    assert (e.name, e.argv) == ("smol", ("llama-server", "-m", "/models/a b.gguf", "--host", "{host}", "--port",
                                         "{port}"))
    assert e.command(8123) == ["llama-server", "-m", "/models/a b.gguf", "--host", "127.0.0.1", "--port", "8123"]
    for bad, text in (("smol", "--engine takes NAME=COMMAND"),
                      ("smol=llama-server -m x.gguf", "the command must pass {port} to the engine"),
                      ("smol=x --port {port} --api-key {key}", "unknown placeholder {key}"),
                      ("smol=x --port {port} 'open", "the command does not parse: No closing quotation"),
                      ("smol=", "the command is empty"),
                      ("a b=x --port {port}", "engine model name 'a b'")):
        with pytest.raises(InvalidInputError) as err:
            parse_engine(bad)
        assert text in err.value.message, (bad, err.value.message)


def test_start_logs_health_transitions_and_stop_kills(caplog):
    caplog.set_level(logging.INFO, logger="kvserve.server")
    child = EngineChild(spec("--loading", "2"))
    child.start()
    try:
        assert child.states == [503, 200]
        pid = child.pid
        assert os.getpgid(pid) == pid  # its own process group
        assert child.base_url == f"http://127.0.0.1:{child.port}/v1"
    finally:
        rc = child.stop("test")
    assert rc == 143 and gone(pid)
    got = lines(caplog)
    assert "[m] loading model" in got and "[m] listening" in got and "[m] received SIGTERM, shutting down" in got
    assert got.index("[m] listening") < got.index("[m] received SIGTERM, shutting down")
    assert [x for x in got if x.startswith("engine 'm': health ")] == ["engine 'm': health 503",
                                                                      "engine 'm': health 200"]
    assert any(x.startswith(f"engine 'm': pid {pid} healthy on port {child.port} in ") and
               x.endswith("s, health states [503, 200]") for x in got)
    assert f"engine 'm': pid {pid} exited with code 143" in got
    assert child.stop() == 143  # idempotent: the same process, already reaped


def test_sigterm_ignored_then_sigkill(caplog, monkeypatch):
    import kvserve.supervisor.child as child_mod

    monkeypatch.setattr(child_mod, "STOP_GRACE_S", 0.5)
    caplog.set_level(logging.INFO, logger="kvserve.server")
    child = EngineChild(spec("--loading", "0", "--ignore-term"))
    child.start()
    pid = child.pid
    assert child.stop() == -signal.SIGKILL and gone(pid)
    assert f"engine 'm': pid {pid} ignored SIGTERM for 0.5 s: SIGKILL" in lines(caplog)
    assert f"engine 'm': pid {pid} exited with SIGKILL (code 137)" in lines(caplog)


def test_exits_at_once_gives_a_clear_error():
    child = EngineChild(spec("--exit", "3"))
    with pytest.raises(EngineStartError) as e:
        child.start()
    assert e.value.message == ("engine for model 'm' exited with code 3 before it became healthy (health states []; "
                               "its last log line: cannot load model)")
    assert isinstance(e.value, ServerFaultError)


def test_never_healthy_times_out_and_is_stopped():
    child = EngineChild(spec("--never-healthy", timeout=1.5))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as e:
        child.start()
    assert time.monotonic() - t0 < 1.5 + 3
    assert e.value.message == ("engine for model 'm' did not become healthy within 1.5 s (health states [503]; its "
                               "last log line: listening); stopped it")
    assert gone(child.pid)


def test_a_program_that_is_not_there():
    child = EngineChild(EngineSpec("m", ("/nonexistent/llama-server", "--port", "{port}")))
    with pytest.raises(EngineStartError) as e:
        child.start()
    assert e.value.message == ("engine for model 'm' cannot start: /nonexistent/llama-server: No such file or "
                               "directory")


def test_a_crash_while_serving_restarts_once(caplog):
    caplog.set_level(logging.INFO, logger="kvserve.server")
    moved = []
    child = EngineChild(spec("--loading", "1"), on_restart=moved.append)
    child.start()
    try:
        first = child.pid
        os.kill(first, signal.SIGKILL)  # the engine crashes
        deadline = time.monotonic() + 30
        while not moved and time.monotonic() < deadline:
            time.sleep(0.05)
        assert moved == [child.port] and child.pid != first and child.restarts == 1 and child.error is None
        assert child.states == [503, 200] and child.alive
        assert (f"engine for model 'm' (pid {first}) exited with SIGKILL (code 137) while serving; "
                "restarting it (once)") in lines(caplog)
        second = child.pid
        os.kill(second, signal.SIGKILL)  # and again: dead for good
        while child.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.error == (f"engine for model 'm' (pid {second}) exited with SIGKILL (code 137) while serving, "
                               "after its one restart; its last log line: listening")
        assert moved == [moved[0]] and not child.alive
    finally:
        child.stop()


def test_the_modelfile_form(tmp_path, tiny_gguf):
    from kvserve.errors import NotFoundError
    from kvserve.supervisor.modelfile import (create_engine_model, engine_files, find_engine, remove_engine,
                                              split_engine)

    assert split_engine("FROM x\n") == (None, 0, "FROM x\n")
    assert split_engine("FROM x\nengine  srv --port {port}  \n") == ("srv --port {port}", 2, "FROM x\n\n")
    with pytest.raises(InvalidInputError, match=r"^\(line 3\): only one ENGINE line is allowed$"):
        split_engine("FROM x\nENGINE a --port {port}\nENGINE b --port {port}\n")
    with pytest.raises(InvalidInputError, match=r"^\(line 1\): ENGINE needs a command"):
        split_engine("ENGINE\nFROM x\n")
    root = tmp_path / "store"
    work = tmp_path / "work"
    (work / "qwen-mlx").mkdir(parents=True)
    text = "# served by mlx-lm\nFROM ./qwen-mlx\nENGINE mlx_lm.server --model {model} --host {host} --port {port}\n"
    spec = create_engine_model(root, "qwen:latest", text, work)
    assert spec.argv == ("mlx_lm.server", "--model", "{model}", "--host", "{host}", "--port", "{port}")
    assert spec.command(9000) == ["mlx_lm.server", "--model", str(work / "qwen-mlx"), "--host", "127.0.0.1",
                                  "--port", "9000"]
    assert find_engine(root, "qwen:latest") == spec and engine_files(root) == [spec]
    assert (root / "kvserve" / "engines" / "qwen%3Alatest.json").is_file()
    # FROM a path given as a GGUF file
    g = create_engine_model(root, "g:latest", f"FROM {tiny_gguf}\nENGINE llama-server -m {{model}} --port {{port}}\n",
                            work)
    assert g.model == tiny_gguf
    for bad, text in (("FROM ./qwen-mlx\nENGINE srv -m {model}\n",
                       "(line 2): engine 'x:latest': the command must pass {port} to the engine"),
                      ("FROM ./qwen-mlx\nPARAMETER temperature 0\nENGINE srv --port {port}\n",
                       "(line 2): a model served by an ENGINE takes one FROM and the ENGINE line only"),
                      ("ENGINE srv --port {port}\n", "no FROM line")):
        with pytest.raises(InvalidInputError) as e:
            create_engine_model(root, "x:latest", bad, work)
        assert text in e.value.message, e.value.message
    with pytest.raises(NotFoundError, match="no such file or directory: ./nothere"):
        create_engine_model(root, "x:latest", "FROM ./nothere\nENGINE srv --port {port}\n", work)
    assert find_engine(root, "x:latest") is None
    assert remove_engine(root, "qwen:latest") and not remove_engine(root, "qwen:latest")
    assert [s.name for s in engine_files(root)] == ["g:latest"]


def test_shown_command_redacts_key_like_values():
    """``show``'s engine command: secrets in environment assignments, in options (both spellings)
    and key-shaped words are ``***``; paths, ports and look-alikes (``--tokenizer``,
    ``--ssl-keyfile``, ``PATH=``) are kept."""
    from kvserve.supervisor.spec import shown_command

    argv = ["env", "HF_TOKEN=hf_abcdefghijklmnop", "OPENAI_API_KEY=x", "AWS_SECRET_ACCESS_KEY=y", "PATH=/usr/bin",
            "EMPTY_TOKEN=", "vllm", "serve", "{model}", "--api-key", "k1", "--hf-token=k2", "--password", "p",
            "--tokenizer", "tok", "--ssl-keyfile", "k.pem", "--port", "{port}", "--header",
            "Authorization: Bearer sk-abcdefghijklmnop", "--api-key"]
    assert shown_command(argv) == (
        "env 'HF_TOKEN=***' 'OPENAI_API_KEY=***' 'AWS_SECRET_ACCESS_KEY=***' PATH=/usr/bin EMPTY_TOKEN= vllm serve "
        "'{model}' --api-key '***' '--hf-token=***' --password '***' --tokenizer tok --ssl-keyfile k.pem "
        "--port '{port}' --header 'Authorization: Bearer ***' --api-key")


def test_spawn_fixes_group_fds_and_parent_death():
    """kvserve.procs.spawn: its own process group, no inherited descriptor, and the fixed
    arguments refused."""
    import subprocess

    from kvserve import procs

    r, w = os.pipe()  # inheritable descriptors the child must not see
    os.set_inheritable(r, True)
    try:
        code = "import json, os; print(os.getpgid(0), json.dumps(sorted(os.listdir('/proc/self/fd'))))"
        p = procs.spawn([sys.executable, "-c", code], stdout=subprocess.PIPE)
        out, _ = p.communicate(timeout=30)
    finally:
        os.close(r)
        os.close(w)
    pgid, fds = out.decode().split(" ", 1)
    assert int(pgid) == p.pid
    assert json.loads(fds) == ["0", "1", "2", "3"]  # stdio and listdir's own descriptor
    for fixed in ("start_new_session", "close_fds", "preexec_fn", "process_group"):
        with pytest.raises(TypeError, match=f"^procs.spawn fixes {fixed}$"):
            procs.spawn(["true"], **{fixed: None})
