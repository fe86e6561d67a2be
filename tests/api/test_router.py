"""kvserve replicas behind the vLLM project's router (``vllm-router`` 0.1.17, ``--policy
cache_aware``): two ``kvserve serve`` processes of the tiny random model and the router, all on
127.0.0.1 (free ports), stopped by pid at the end.

* the worker endpoints the router reads (:mod:`kvserve.faces.router`): render = the ids the
  OpenAI face prefills, ``/get_load`` counts a stream in flight, the router's ``/get_loads``;
* 4 agents, each with its own ~650-token prefix, 5 requests each (20): both replicas serve,
  each agent's requests all land on one replica, and from the second request on, the prompt
  tokens it reuses (``cached_tokens`` = ``timings.cache_n``) are exactly the common prefix with
  its own earlier prompts (>= the prefix length);
* a stream passes through the router unchanged (same greedy text as without streaming);
* stopping the replica an agent is on moves the agent to the other one: every request
  succeeds (``--cb-failure-threshold 1``: the failed attempt is retried there), and the next one
  hits the prefix there.

Which replica served a request: each runs with its own ``-a`` alias, which the response's
``model`` names (a request's model name is answered by the one pinned model, as llama-server).
The tests that need the router are skipped when the ``vllm-router`` executable is absent (it is
in the ``test`` extra). ``-dp N`` above 1 is refused with the recipe (kvserve starts no replicas).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import tinymodel
from servers import Server, free_port, spawn


def _router_exe() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


ROUTER_EXE = _router_exe()
needs_router = pytest.mark.skipif(ROUTER_EXE is None, reason="the vllm-router executable is not installed "
                                  "(pip install vllm-router==0.1.17; it is in kvserve's test extra)")

ALIASES = ("rep-a", "rep-b")
AGENTS = ("Ada", "Bo", "Cy", "Di")
WORDS = ("alpha beta gamma delta kernel buffer tensor cache block slot router replica token prefix module "
         "parser").split()


def prefix_text(name: str, n_words: int = 130) -> str:
    """An agent's own long system prompt (~650 tokens of the tiny model), deterministic."""
    rnd = random.Random(name)
    return f"{name} notes: " + " ".join(rnd.choice(WORDS) for _ in range(n_words))


def messages(name: str, k: int) -> list[dict]:
    return [{"role": "system", "content": prefix_text(name)},
            {"role": "user", "content": f"{name}, question {k}: what is step {k * 7}?"}]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Router:
    """A running ``vllm-router`` process."""

    def __init__(self, workers: list[str], logdir: Path, *extra: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = logdir / f"router-{self.port}.log"
        cmd = [ROUTER_EXE, "--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1",
               "--port", str(self.port), "--prometheus-port", str(free_port()), "--cb-failure-threshold", "1",
               "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1", *extra]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm-router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/readiness", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"vllm-router not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s (its graceful shutdown can wait much longer)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[Server]:
    d = tmp_path_factory.mktemp("router")
    model = str(tinymodel.write_tiny_gguf(d / "tiny.gguf", ctx=4096))
    servers = [spawn(model, ("-a", alias, "-c", "8192", "-np", "4", "-t", "1"), d) for alias in ALIASES]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = Router([s.base_url for s in replicas], tmp_path_factory.mktemp("router_log"))
    try:
        yield r.wait_ready()
    finally:
        r.stop()


def chat(client: httpx.Client, base: str, msgs: list[dict], **extra) -> dict:
    body = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0, **extra}
    r = client.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_dp_above_one_is_refused_with_the_recipe(capsys):
    from kvserve.serving.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "-dp", "2"], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --data-parallel-size 2: kvserve does not start replicas itself; start 2 `kvserve serve` processes "
        "on ports of their own and put vllm-router in front: vllm-router --worker-urls http://127.0.0.1:PORT1 "
        "http://127.0.0.1:PORT2 ... --policy cache_aware --cb-failure-threshold 1 (README: Replicas behind "
        "vLLM's router)")
    assert parse_args(["m.gguf", "--data-parallel-size", "1"], environ={}).data_parallel_size == 1


def test_worker_endpoints_the_router_reads(replicas):
    w = replicas[0].base_url
    msgs = messages("Gus", 1)  # not an agent of the routing tests: their first requests find no cache
    tok = httpx.post(w + "/tokenize", json={"messages": msgs}).json()["tokens"]
    r = httpx.post(w + "/v1/chat/completions/render", json={"model": "x", "messages": msgs, "max_tokens": 5,
                                                             "temperature": 0, "cache_salt": "s1"})
    assert r.status_code == 200, r.text
    g = r.json()
    assert list(g) == ["request_id", "token_ids", "features", "sampling_params", "model", "stream",
                       "stream_options", "cache_salt", "priority", "kv_transfer_params"]
    assert g["token_ids"] == tok and g["model"] == "rep-a" and g["cache_salt"] == "s1"
    assert g["sampling_params"]["max_tokens"] == 5 and g["sampling_params"]["temperature"] == 0.0
    done = chat(httpx.Client(), w, msgs, max_tokens=1)
    assert done["usage"]["prompt_tokens"] == len(tok)
    # completions: one GenerateRequest per prompt, as vLLM
    r = httpx.post(w + "/v1/completions/render", json={"prompt": ["ab", "cd"], "n": 2})
    assert [x["token_ids"] for x in r.json()] == [[100, 101], [102, 103]]
    assert r.json()[0]["sampling_params"]["max_tokens"] == 16  # OpenAI's completions default
    # the OpenAI face's checks and texts
    r = httpx.post(w + "/v1/chat/completions/render", json={"messages": 3})
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": "Expected 'messages' to be an array, got number",
                                  "type": "invalid_request_error"}}
    r = httpx.post(w + "/v1/completions/render", json={"prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Field 'prompt': the prompt is empty"
    # load: requests in the engine
    assert httpx.get(w + "/get_load").json() == {"load": 0}
    assert httpx.get(w + "/load").json() == {"server_load": 0}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1800,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", w + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the stream runs for seconds
        assert httpx.get(w + "/get_load").json() == {"load": 1}
        assert httpx.get(w + "/load").json() == {"server_load": 1}
    # closed early: the generation is aborted
    deadline = time.monotonic() + 10
    while httpx.get(w + "/get_load").json() != {"load": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(w + "/get_load").json() == {"load": 0}


@needs_router
def test_router_reads_loads(router, replicas):
    loads = httpx.get(router.base_url + "/get_loads").json()
    assert sorted(x["worker"] for x in loads["workers"]) == sorted(s.base_url for s in replicas)
    assert [x["load"] for x in loads["workers"]] == [0, 0]  # -1 would mean "no /get_load"


@needs_router
def test_agents_land_where_their_prefix_is_cached(router, replicas):
    tok_client = httpx.Client()
    ids = {(a, k): tok_client.post(replicas[0].base_url + "/tokenize", json={"messages": messages(a, k)}).json()
           ["tokens"] for a in AGENTS for k in range(1, 6)}
    results: dict[tuple[str, int], dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(AGENTS))

    def agent(name: str) -> None:
        try:
            with httpx.Client() as c:
                start.wait()
                # the first requests overlap (64 tokens each), so that the router's load count
                # spreads the four agents, which share no prefix, over both replicas
                results[(name, 1)] = chat(c, router.base_url, messages(name, 1), max_tokens=64, ignore_eos=True)
                for k in range(2, 6):
                    results[(name, k)] = chat(c, router.base_url, messages(name, k))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(a,)) for a in AGENTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 20
    served = {a: {results[(a, k)]["model"] for k in range(1, 6)} for a in AGENTS}
    assert all(len(s) == 1 for s in served.values()), served  # each agent stays on one replica
    assert {next(iter(s)) for s in served.values()} == set(ALIASES), served  # and both replicas serve
    prefix_len = lcp(ids[("Ada", 1)], ids[("Ada", 2)])
    assert prefix_len > 600
    for a in AGENTS:
        first = results[(a, 1)]
        assert first["usage"]["prompt_tokens"] == len(ids[(a, 1)])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 20  # at most the template's head
        for k in range(2, 6):
            r = results[(a, k)]
            want = max(lcp(ids[(a, j)], ids[(a, k)]) for j in range(1, k))
            assert want >= prefix_len - 5
            assert r["usage"]["prompt_tokens"] == len(ids[(a, k)])
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == want, (a, k, r["usage"])
            assert r["timings"]["cache_n"] == want
            assert r["timings"]["prompt_n"] == len(ids[(a, k)]) - want


@needs_router
def test_stream_passes_through(router):
    msgs = messages("Eve", 1)
    plain = chat(httpx.Client(), router.base_url, msgs, max_tokens=12)
    body = {"model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=body, timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert {c["model"] for c in chunks} == {plain["model"]}  # the same replica (same prefix)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # all but one


@needs_router
def test_stopping_a_replica_moves_its_traffic(router, replicas):
    """Last in the module: it stops a replica."""
    c = httpx.Client()
    first = chat(c, router.base_url, messages("Fay", 1))
    victim = replicas[ALIASES.index(first["model"])]
    survivor = ALIASES[1 - ALIASES.index(first["model"])]
    victim.stop()
    # the router still believes the victim is up: the attempt fails, the circuit opens, and the
    # retry goes to the survivor; the client sees one answer
    moved = [chat(c, router.base_url, messages("Fay", k)) for k in (2, 3, 4)]
    assert [r["model"] for r in moved] == [survivor] * 3
    tok = [c.post(router.base_url + "/tokenize", json={"model": "tiny", "messages": messages("Fay", k)}).json()
           ["tokens"] for k in (2, 3, 4)]
    # the survivor had not seen Fay's prefix: the first moved request computes it, the next reuse it
    assert moved[0]["usage"]["prompt_tokens_details"]["cached_tokens"] < 20
    assert moved[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == lcp(tok[0], tok[1])
    assert moved[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == max(lcp(tok[0], tok[2]),
                                                                              lcp(tok[1], tok[2]))
    # the other agents' traffic goes there too, and succeeds
    assert {chat(c, router.base_url, messages(a, 6))["model"] for a in AGENTS} == {survivor}
