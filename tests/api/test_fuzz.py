"""Fuzz every route with hypothesis (issue #11, "keep it fixed"): no input may get a 5xx,
break the error envelope or kill the engine.

One server with the tiny random model (``-np 2 -c 512``, every optional endpoint on) gets a
fixed matrix (``fuzz_bodies.matrix_cases``: each generation dialect x each fragile field x its
worst values, ~1,000 requests) and then ``KVSERVE_FUZZ_CASES`` requests (default 500) drawn by
hypothesis from ``tests/fuzz_bodies.py``, one at a time on one keep-alive connection, as raw
bytes. ``KVSERVE_FUZZ_URL`` (and ``KVSERVE_FUZZ_LOG``, its log) fuzzes a server already
running instead (it needs ``--slots --props --metrics --slot-save-path DIR``). Per request:

* the status is below 500, except 501 from the embedding and rerank routes (a generative model
  without ``--embeddings``), 501 from ``/infill`` (a vocabulary without FIM tokens, as
  llama-server answers) and 503
  from ``GET /slots?fail_on_no_slot=1`` (both deliberate answers in the envelope);
* every error body is ``{"error": {"code": <the status>, "message": str, "type": str}}``;
* a 2xx JSON body parses as strict JSON (no NaN/Infinity); a 2xx event stream's ``data:``
  lines are strict JSON or ``[DONE]`` and it ends as its dialect ends (``[DONE]``, or
  ``"stop": true`` on /completion), or with a 4xx error event.

GET /slots must answer 200 with strict JSON every 50 requests and after each failure.
Failures are collected, not raised one at a time, so that one run reports every cause:
grouped by cause (the exception the server logged, else the problem), each with its routes,
its shortest request and the server's traceback. A 5xx is followed by a small /completion:
if that fails too, the request killed the engine and the run stops there. Afterwards
/health is 200, a small /completion is 200 and every slot is idle.

The run is deterministic (``derandomize=True``). A long run (``-s`` prints the figures):
``KVSERVE_FUZZ_CASES=10000 python -m pytest -s -p no:cacheprovider tests/api/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

import fuzz_bodies
from fuzz_bodies import EMBEDDINGS, LLAMA_GEN, Case

N_CASES = int(os.environ.get("KVSERVE_FUZZ_CASES", "500"))
TIMEOUT_S = 30.0  # per request: far above any answer of the tiny model; beyond it the case "hung"
SLOTS_EVERY = 50  # GET /slots after every this many requests (and after each failure)
MAX_HANGS = 3  # after this many hung requests the server is presumed stuck and the run stops


def _no_constants(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(text: str):
    """``json.loads`` that refuses NaN/Infinity (what a JSON client refuses)."""
    return json.loads(text, parse_constant=_no_constants)


def envelope_problem(status: int, text: str) -> str | None:
    """Why ``text`` is not the error envelope for ``status`` (None when it is)."""
    try:
        body = strict_json(text)
    except ValueError as e:
        return f"error body is not JSON ({e}): {text[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"error body has no 'error' object: {text[:200]!r}"
    if not (type(err.get("code")) is int and err["code"] == status and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str)):
        return f"error envelope malformed for status {status}: {text[:200]!r}"
    return None


def stream_problem(route: str, text: str) -> str | None:
    """Why an event stream is broken or incomplete (None when it is whole)."""
    events = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(line[6:])
    if not events:
        return "stream without data events"
    for data in events:
        if data == "[DONE]":
            continue
        try:
            ev = strict_json(data)
        except ValueError as e:
            return f"stream event is not JSON ({e}): {data[:200]!r}"
        if isinstance(ev, dict) and "error" in ev:
            err = ev["error"]
            code = err.get("code") if isinstance(err, dict) else None
            if type(code) is not int or code >= 500:
                return f"error event in stream: {data[:300]}"
    last = events[-1]
    if last == "[DONE]" or '"error"' in last[:12]:
        return None
    if route in LLAMA_GEN:
        ev = strict_json(last)
        if isinstance(ev, dict) and ev.get("stop") is True:
            return None
    return f"stream ended without its final event: {last[:200]!r}"


def allowed_5xx(case: Case, status: int) -> bool:
    return (status == 501 and case.route in (*EMBEDDINGS, "/rerank", "/infill")) or \
        (status == 503 and case.route == "/slots" and "fail_on_no_slot" in case.path)


def check_response(case: Case, r: httpx.Response) -> str | None:
    """Why this answer breaks the rules above (None when it keeps them)."""
    status, ctype = r.status_code, r.headers.get("content-type", "")
    if status >= 500 and not allowed_5xx(case, status):
        return f"status {status}: {r.text[:300]}"
    if case.method == "HEAD":
        return None
    if status >= 400:
        return envelope_problem(status, r.text)
    if "text/event-stream" in ctype:
        return stream_problem(case.route, r.text)
    if "json" in ctype:
        try:
            strict_json(r.text)
        except ValueError as e:
            return f"2xx body is not JSON ({e}): {r.text[:200]!r}"
    return None


@dataclass
class Failure:
    case: Case
    problem: str
    traceback: str = ""
    seq: int = 0


@dataclass
class Run:
    """What the fuzz run saw (shared by the hypothesis examples of one test)."""

    client: httpx.Client
    log_path: str | None
    failures: list[Failure] = field(default_factory=list)
    n_sent: int = 0
    n_hung: int = 0
    statuses: dict = field(default_factory=dict)
    stopped: str = ""

    def send(self, case: Case) -> None:
        if self.stopped or self.n_hung >= MAX_HANGS:
            return
        log_at = os.path.getsize(self.log_path) if self.log_path else 0
        self.n_sent += 1
        try:
            r = self.client.request(case.method, case.path, content=case.body or None, headers=case.headers)
        except httpx.TimeoutException as e:
            self.n_hung += 1
            self._fail(case, f"hung: no answer in {TIMEOUT_S:.0f} s ({type(e).__name__})")
            self._probe(case)
            return
        except httpx.HTTPError as e:  # e.g. the server closed the keep-alive connection
            self._fail(case, f"connection error: {type(e).__name__}: {e}", self._log(log_at))
            return
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        problem = check_response(case, r)
        if problem:
            self._fail(case, problem, self._log(log_at) if r.status_code >= 500 else "")
            if r.status_code >= 500:
                self._probe(case)
        if self.n_sent % SLOTS_EVERY == 0 or (problem and not self.stopped):
            self._check_slots(case)

    def _check_slots(self, case: Case) -> None:
        """GET /slots answers 200 with strict JSON (a bad value kept in a slot's params broke it)."""
        log_at = os.path.getsize(self.log_path) if self.log_path else 0
        try:
            r = self.client.get("/slots")
            strict_json(r.text)
            problem = "" if r.status_code == 200 else f"{r.status_code}: {r.text[:300]}"
        except (httpx.HTTPError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            self._fail(case, f"GET /slots after this request: {problem}", self._log(log_at))

    def _fail(self, case: Case, problem: str, traceback: str = "") -> None:
        self.failures.append(Failure(case, problem, traceback, self.n_sent))

    def _probe(self, case: Case) -> None:
        """After a 5xx: stop the run if a small /completion now fails (this case killed the engine)."""
        try:
            r = self.client.post("/completion", json={"prompt": "Hi", "n_predict": 1}, timeout=TIMEOUT_S)
            dead = "" if r.status_code == 200 else f"{r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            dead = f"{type(e).__name__}: {e}"
        if dead:
            self.stopped = f"run stopped after request #{self.n_sent}: a small /completion then got {dead}"
            self._fail(case, "engine dead after this request", self.failures[-1].traceback)

    def _log(self, since: int) -> str:
        """The server's traceback (if any) logged since byte ``since``."""
        if not self.log_path:
            return ""
        time.sleep(0.05)  # the log line is written just after the answer
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
        i = text.find("Traceback")
        if i < 0:
            return text[-2000:]
        j = text.find("Traceback (most recent call last)", i + 1)  # today a 500 is logged twice
        return text[i:j] if j > 0 else text[i:]

    def report(self) -> str:
        """Failures grouped by cause (the logged exception, else the problem; digits folded),
        each with its routes, its shortest request and its server traceback."""
        groups: dict[str, list[Failure]] = {}
        for f in self.failures:
            cause = traceback_summary(f.traceback)[-1] if f.traceback else f.problem
            if f.problem.startswith("GET /slots"):
                cause = "GET /slots: " + cause
            cause = re.sub(r"\d+", "#", re.sub(r"\\u[0-9a-fA-F]{4}", r"\\uXXXX", cause))
            groups.setdefault(cause[:120], []).append(f)
        out = [f"{len(self.failures)} of {self.n_sent} requests broke the rules, {len(groups)} causes:"]
        for cause, fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            f = min(fs, key=lambda f: len(f.case.body))
            routes = dict(Counter(f"{g.case.method} {g.case.route}" for g in fs))
            out.append(f"\n== {len(fs)} x {cause}\n   routes: {routes}, first at request #{fs[0].seq}\n"
                       f"   problem: {f.problem[:300]}\n   shortest: {f.case.describe()}")
            if f.traceback:
                out.append("   server log:\n      " + "\n      ".join(traceback_summary(f.traceback)))
        if self.stopped:
            out.append("\n" + self.stopped)
        return "\n".join(out)


def traceback_summary(text: str) -> list[str]:
    """The kvserve frames (file line and code) and the exception line of a logged traceback."""
    lines = text.strip().splitlines()
    keep = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("File ") and "/kvserve/" in line and "site-packages" not in line:
            keep.append(line.strip())
            if i + 1 < len(lines):
                keep.append("    " + lines[i + 1].strip())
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    return keep[-10:] + [(errors or lines or [""])[-1]]


@dataclass
class Target:
    base_url: str
    log_path: str | None


@pytest.fixture(scope="module")
def fuzz_server(request, tmp_path_factory):
    """The tiny model, 2 slots of 256 tokens, /slots, /props, /metrics and slot files on; or the
    server at $KVSERVE_FUZZ_URL (its log at $KVSERVE_FUZZ_LOG, if given, for tracebacks)."""
    if os.environ.get("KVSERVE_FUZZ_URL"):
        return Target(os.environ["KVSERVE_FUZZ_URL"].rstrip("/"), os.environ.get("KVSERVE_FUZZ_LOG"))
    start, tiny = request.getfixturevalue("start_server_module"), request.getfixturevalue("tiny_gguf")
    slot_dir = tmp_path_factory.mktemp("fuzz-slots")
    srv = start("-np", "2", "-c", "512", "--slots", "--props", "--metrics", "--slot-save-path", str(slot_dir),
                model=tiny)
    return Target(srv.base_url, str(srv.log_path))


def test_fuzz_every_route(fuzz_server):
    """N_CASES hostile requests: no 5xx, the envelope on every error, whole streams, and the
    engine alive and every slot idle afterwards."""
    with httpx.Client(base_url=fuzz_server.base_url, timeout=TIMEOUT_S) as client:
        run = Run(client, fuzz_server.log_path)

        @settings(max_examples=N_CASES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])
        @given(case=fuzz_bodies.cases())
        def fuzz(case: Case) -> None:
            run.send(case)

        t0 = time.monotonic()
        for case in fuzz_bodies.matrix_cases():
            run.send(case)
        t1 = time.monotonic()
        if not run.stopped:
            fuzz()
        print(f"\nfuzz: {run.n_sent} requests ({len(run.failures)} failures), statuses "
              f"{dict(sorted(run.statuses.items()))}; matrix {t1 - t0:.1f} s, "
              f"{N_CASES} hypothesis cases {time.monotonic() - t1:.1f} s")
        after = check_alive(client)
    if run.failures or after:
        summary = f"{run.n_sent} sent, statuses {dict(sorted(run.statuses.items()))}"
        pytest.fail(f"{summary}\n{run.report()}\n{after}", pytrace=False)


def check_alive(client: httpx.Client) -> str:
    """'' when /health is 200, a small /completion is 200 and every slot is idle (within 10 s)."""
    problems = []
    try:
        h = client.get("/health", timeout=10)
        if h.status_code != 200:
            problems.append(f"after the run /health is {h.status_code}: {h.text[:200]}")
        c = client.post("/completion", json={"prompt": "Hello", "n_predict": 2, "temperature": 0}, timeout=30)
        if c.status_code != 200 or not isinstance(c.json().get("content"), str):
            problems.append(f"after the run /completion is {c.status_code}: {c.text[:300]}")
        deadline = time.monotonic() + 10
        while True:
            s = client.get("/slots", timeout=10)
            busy = [v.get("id") for v in s.json() if v.get("is_processing")] if s.status_code == 200 else None
            if busy == [] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if busy != []:
            problems.append(f"after the run GET /slots is {s.status_code}, busy slots {busy}: {s.text[:300]}")
    except httpx.HTTPError as e:
        problems.append(f"after the run the server does not answer: {type(e).__name__}: {e}")
    return "\n".join(problems)
