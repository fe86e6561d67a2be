"""``kvserve serve -tp 2`` / ``-pp 2`` as processes (kvserve.engine.parallel, gloo on the CPU).

The tiny model under ``--dtype float32``: the same tokens as a one-process server, with
prefix-cache hits (``cache_n``) and chunked prefill (``-b 16``), a grammar; SIGTERM leaves no
worker process; a worker killed with SIGKILL (idle server) turns ``/health`` into 500 and the
next request into the engine-dead error within a second; a worker lost during start-up, or a
SIGTERM then, ends the server within seconds (not gloo's 121 s rendezvous wait). Slow: SmolLM2 ``-tp 2`` exits with the seed's
error before reading weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tinymodel
from servers import REPO, free_port, spawn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("par") / "tiny.gguf", seed=5))


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (from /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def workers_of(pid: int) -> list[int]:
    """The ``python -m kvserve.engine.parallel`` children of ``pid`` (a server has other children too)."""
    out = []
    for c in children(pid):
        try:
            if b"kvserve.engine.parallel" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


FLAGS = ("--dtype", "float32", "-c", "1024", "-np", "2", "-b", "16")
PROMPTS = ["the quick brown fox jumps over the lazy dog and then it runs far away",
           "the quick brown fox jumps over the lazy dog and then it sleeps"]


def _complete(srv, prompt: str, **kw) -> dict:
    r = httpx.post(srv.url("/completion"), timeout=60,
                   json={"prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True,
                         "return_tokens": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    out = {}
    try:
        for name, extra in (("one", ()), ("tp2", ("-tp", "2")), ("pp2", ("-pp", "2"))):
            out[name] = spawn(tiny, FLAGS + extra, logdir)
        for srv in out.values():
            srv.wait_ready()
        yield out
    finally:
        for srv in out.values():
            srv.stop()


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_same_tokens_as_one_process_with_prefix_hits_and_chunked_prefill(servers, name):
    one, par = servers["one"], servers[name]
    for i, prompt in enumerate(f"{name} {p}" for p in PROMPTS):  # prompts no earlier test cached
        want, got = _complete(one, prompt), _complete(par, prompt)
        assert got["tokens"] == want["tokens"]
        assert got["content"] == want["content"]
        assert got["timings"]["prompt_n"] == want["timings"]["prompt_n"]
        assert got["timings"]["cache_n"] == want["timings"]["cache_n"]
        if i == 1:  # the second prompt shares the first's prefix: a prefix-cache hit
            assert got["timings"]["cache_n"] > 8
    log = par.log()
    assert ("tp=2 pp=1" if name == "tp2" else "tp=1 pp=2") + "  ranks=2  weights/rank=" in log


def test_grammar_through_tp2(servers):
    grammar = 'root ::= ("yes" | "no") " " ("yes" | "no")'
    want = _complete(servers["one"], "answer:", grammar=grammar)
    got = _complete(servers["tp2"], "answer:", grammar=grammar)
    assert got["content"] == want["content"]
    assert got["content"] in ("yes yes", "yes no", "no yes", "no no")


def test_sigterm_leaves_no_worker(tiny, tmp_path):
    srv = spawn(tiny, FLAGS + ("-tp", "2"), tmp_path)
    try:
        srv.wait_ready()
        workers = workers_of(srv.proc.pid)
        assert len(workers) == 1
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=20)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in workers if alive(p)] == []
    finally:
        srv.stop()


def test_killed_worker_is_a_clear_error_not_a_hang(tiny, tmp_path):
    srv = spawn(tiny, FLAGS + ("-tp", "2"), tmp_path)
    try:
        srv.wait_ready()
        _complete(srv, PROMPTS[0])
        (worker,) = workers_of(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        time.sleep(0.5)
        t0 = time.monotonic()
        r = httpx.post(srv.url("/completion"), timeout=30, json={"prompt": "hello", "n_predict": 4})
        assert time.monotonic() - t0 < 10
        assert r.status_code == 500
        assert r.json() == {"error": {"code": 500, "type": "server_error", "message": (  # dead before it came
            "the engine failed (ParallelWorkerLost) and serves no more requests: restart the server")}}
        assert f"parallel worker rank 1 (pid {worker}) exited (signal SIGKILL): the engine is dead" in srv.log()
        h = httpx.get(srv.url("/health"), timeout=10)
        assert h.status_code == 500
        assert h.json()["error"]["message"] == ("the engine failed (ParallelWorkerLost) and serves no more "
                                                "requests: restart the server")
        r = httpx.post(srv.url("/completion"), timeout=30, json={"prompt": "hello", "n_predict": 4})
        assert r.status_code == 500 and "ParallelWorkerLost" in r.json()["error"]["message"]
        assert srv.proc.poll() is None  # the server itself keeps answering
    finally:
        srv.stop()


@pytest.mark.slow
def test_smollm2_tp2_exits_with_the_seeds_error(smollm2_path):
    p = subprocess.run([sys.executable, "-m", "kvserve", "serve", smollm2_path, "--host", "127.0.0.1", "--port",
                        str(free_port()), "-tp", "2"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 1
    out = p.stdout + p.stderr
    assert "Total number of attention heads (9) must be divisible by tensor parallel size (2)." in out
    assert "Traceback" not in out


def _first_worker(srv, timeout: float = 60.0) -> int:
    """The worker's pid as soon as the server spawned it (start-up still under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in workers_of(srv.proc.pid):
            return pid
        assert srv.proc.poll() is None, srv.log()
        time.sleep(0.02)
    raise AssertionError("no worker spawned")


def test_worker_killed_during_start_up_exits_at_once_naming_it(tiny, tmp_path):
    """Issue 23 item 1 repro A: /health said "Loading model" for ~121 s, then gloo's DistStoreError."""
    srv = spawn(tiny, FLAGS + ("-pp", "2"), tmp_path)
    try:
        worker = _first_worker(srv)
        os.kill(worker, signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == 1
        log = srv.log()
        assert (f"failed to load model '{tiny}': parallel worker rank 1 (pid {worker}) exited (signal SIGKILL) "
                "while the parallel group formed") in log
        assert "Traceback" not in log
    finally:
        srv.stop()


def test_group_sigterm_during_start_up_exits_within_seconds(tiny, tmp_path):
    """Issue 23 item 1 repro B: ``kill -TERM -- -<pgid>`` during start-up (timeout, systemd) reaches the
    server and its worker; the server used to ignore it for the whole collective timeout."""
    srv = spawn(tiny, FLAGS + ("-tp", "2"), tmp_path)
    try:
        worker = _first_worker(srv)
        t0 = time.monotonic()
        os.kill(worker, signal.SIGTERM)
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 20
        assert not alive(worker)
    finally:
        srv.stop()


def test_worker_killed_while_idle_turns_health_500_at_once(tiny, tmp_path):
    """Issue 23 item 2: /health said ok until a request failed."""
    srv = spawn(tiny, FLAGS + ("-pp", "2"), tmp_path)
    try:
        srv.wait_ready()
        (worker,) = workers_of(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 5
        h = httpx.get(srv.url("/health"), timeout=10)
        while h.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            h = httpx.get(srv.url("/health"), timeout=10)
        assert h.status_code == 500
        assert h.json() == {"error": {"code": 500, "type": "server_error", "message": (
            "the engine failed (ParallelWorkerLost) and serves no more requests: restart the server")}}
        r = httpx.post(srv.url("/completion"), timeout=30, json={"prompt": "hello", "n_predict": 4})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == h.json()["error"]["message"]
        assert f"parallel worker rank 1 (pid {worker}) exited (signal SIGKILL): the engine is dead" in srv.log()
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_a_torchrun_environment_without_tp_pp_is_refused(tiny):
    """Issue 23 item 3: RANK/WORLD_SIZE of a group with no -tp/-pp used to start one process silently."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-m", "kvserve", "serve", tiny, "--host", "127.0.0.1", "--port",
                        str(free_port()), *FLAGS], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 1
    out = p.stdout + p.stderr
    assert ("RANK=0 WORLD_SIZE=2 in the environment (a torch.distributed group to join) but tp x pp = 1 (tp=1 "
            "pp=1): give -tp/-pp for the group's size, or unset RANK to start one process") in out
    assert "Traceback" not in out
