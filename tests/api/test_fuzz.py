"""Fuzz every route with hypothesis (issue #11, "keep it fixed"): no input may get a 5xx,
break the error envelope or kill the engine.

One server with the tiny random model (``-np 2 -c 512``, every optional endpoint on) gets a
fixed matrix (``fuzz_bodies.matrix_cases``: each generation dialect x each fragile field x its
worst values, the Responses and Messages fields and members deep in their bodies, ~1,400
requests) and then ``KVSERVE_FUZZ_CASES`` requests (default 500) drawn by hypothesis from
``tests/fuzz_bodies.py``, one at a time on one keep-alive connection, as raw bytes. ``KVSERVE_FUZZ_URL`` (and ``KVSERVE_FUZZ_LOG``, its log) fuzzes a server already
running instead (it needs ``--slots --props --metrics --slot-save-path DIR``). Per request:

* the status is below 500, except 501 from the embedding and rerank routes (a generative model
  without ``--embeddings``), 501 from ``/infill`` (a vocabulary without FIM tokens, as
  llama-server answers) and 503
  from ``GET /slots?fail_on_no_slot=1`` (both deliberate answers in the envelope);
* every error body is ``{"error": {"code": <the status>, "message": str, "type": str}}``, on
  ``/v1/messages...`` Anthropic's ``{"type": "error", "error": {"type": <the status's>,
  "message": str}}`` (no ``code``);
* a 2xx JSON body parses as strict JSON (no NaN/Infinity) and, on the Responses and Messages
  routes, is their object (a response completed or incomplete, a message, ``{"input_tokens"}``);
  a 2xx event stream's ``data:`` lines are strict JSON or ``[DONE]`` and it ends as its dialect
  ends (``[DONE]``, or ``"stop": true`` on /completion), or with a 4xx error event. A Responses
  stream: ``event:`` names matching each ``type``, ``sequence_number`` from 0, response.created
  first and one of response.completed / .incomplete / .failed last (not a server fault), no
  ``[DONE]``; a Messages stream: message_start first, content blocks opened, fed and closed in
  index order, one message_delta, message_stop last (or an ``error`` event that is not
  ``api_error``);
* ``GET /`` is 200: the page (text/html) when Accept names text/html, else ``Ollama is running``.

A case whose path or body holds ``fuzz_bodies.REAL_ID`` gets the id of a response the run stored
(the last 8 POST /v1/responses answers with ``store``; a deleted one is forgotten).

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
from dataclasses import dataclass, field, replace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

import fuzz_bodies
from fuzz_bodies import EMBEDDINGS, LLAMA_GEN, REAL_ID, RESPONSES, Case, dialect

N_CASES = int(os.environ.get("KVSERVE_FUZZ_CASES", "500"))
TIMEOUT_S = 30.0  # per request: far above any answer of the tiny model; beyond it the case "hung"
SLOTS_EVERY = 50  # GET /slots after every this many requests (and after each failure)
MAX_HANGS = 3  # after this many hung requests the server is presumed stuck and the run stops


def _no_constants(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(text: str):
    """``json.loads`` that refuses NaN/Infinity (what a JSON client refuses)."""
    return json.loads(text, parse_constant=_no_constants)


#: Anthropic's error type for each status (kvserve/faces/anthropic.py's table, Anthropic's docs)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_problem(body, status: int | None) -> str | None:
    """Why ``body`` is not ``{"type": "error", "error": {"type": <the status's>, "message": str}}``
    (no ``code``); ``status`` None (an error event in a stream): any type but ``api_error``."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(err, dict):
        return "not Anthropic's error envelope"
    if not isinstance(err.get("message"), str) or "code" in err or not isinstance(err.get("type"), str):
        return "Anthropic's error object malformed"
    if status is not None and err["type"] != ANTHROPIC_ERROR_TYPES.get(status, err["type"]):
        return f"error type {err['type']!r} for status {status}"
    if status is None and err["type"] == "api_error":
        return "a server fault (api_error)"
    return None


def envelope_problem(status: int, text: str, dialect: str = "openai") -> str | None:
    """Why ``text`` is not the error envelope for ``status`` in ``dialect`` (None when it is):
    Anthropic's on /v1/messages..., ``{"error": {"code": <status>, ...}}`` everywhere else."""
    try:
        body = strict_json(text)
    except ValueError as e:
        return f"error body is not JSON ({e}): {text[:200]!r}"
    if dialect == "anthropic":
        problem = anthropic_error_problem(body, status)
        return f"{problem} for status {status}: {text[:200]!r}" if problem else None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"error body has no 'error' object: {text[:200]!r}"
    if not (type(err.get("code")) is int and err["code"] == status and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str)):
        return f"error envelope malformed for status {status}: {text[:200]!r}"
    return None


def named_events(text: str) -> list[tuple[str | None, str]]:
    """``(event name or None, data)`` per SSE block (comments and pings without data left out)."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:] if data is None else data + "\n" + line[6:]
        if data is not None:
            out.append((name, data))
    return out


def typed_events(text: str) -> tuple[list[dict], str | None]:
    """The data objects of a stream whose events carry ``event: <type>`` and a JSON object with that
    ``type`` (Anthropic's, OpenAI's Responses), or the first problem."""
    out = []
    for name, data in named_events(text):
        if data == "[DONE]":
            return out, "[DONE] in a stream whose dialect sends none"
        try:
            ev = strict_json(data)
        except ValueError as e:
            return out, f"stream event is not JSON ({e}): {data[:200]!r}"
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str) or ev["type"] != name:
            return out, f"event {name!r} with data {data[:200]!r}"
        out.append(ev)
    if not out:
        return out, "stream without data events"
    return out, None


RESPONSES_END = {"response.completed": "completed", "response.incomplete": "incomplete",
                 "response.failed": "failed"}


def responses_stream_problem(text: str) -> str | None:
    """A Responses stream: typed events numbered from 0, response.created first, nothing after the
    last, which is response.completed / .incomplete / .failed holding the response in that
    status (a failure that is not a server fault), no ``[DONE]``."""
    evs, problem = typed_events(text)
    if problem:
        return problem
    for i, ev in enumerate(evs):
        if ev.get("sequence_number") != i:
            return f"event #{i} has sequence_number {ev.get('sequence_number')!r}: {json.dumps(ev)[:200]}"
    if evs[0]["type"] != "response.created":
        return f"stream starts with {evs[0]['type']!r}"
    last, ends = evs[-1], [ev for ev in evs if ev["type"] in RESPONSES_END]
    if last["type"] not in RESPONSES_END or len(ends) != 1:
        return f"stream ended without its final event: {json.dumps(last)[:200]}"
    resp = last.get("response")
    if not isinstance(resp, dict) or resp.get("status") != RESPONSES_END[last["type"]]:
        return f"{last['type']} holds {json.dumps(resp)[:200]}"
    if last["type"] == "response.failed":
        err = resp.get("error")
        if not isinstance(err, dict) or err.get("code") in (None, "server_error"):
            return f"response.failed with a server fault: {json.dumps(err)[:300]}"
    return None


def anthropic_stream_problem(text: str) -> str | None:
    """A Messages stream: typed events, message_start first (pings aside), content blocks opened
    from index 0 up, each delta in the open block, each closed; one message_delta; message_stop
    last, or an ``error`` event (not a server fault) ending it. No ``[DONE]``."""
    evs, problem = typed_events(text)
    if problem:
        return problem
    evs = [ev for ev in evs if ev["type"] != "ping"]
    if not evs or evs[0]["type"] != "message_start":
        return f"stream starts with {evs[0]['type'] if evs else None!r}"
    open_index, next_index, deltas = None, 0, 0
    for ev in evs[1:]:
        t = ev["type"]
        if t == "error":
            if ev is not evs[-1]:
                return "events after the error event"
            problem = anthropic_error_problem(ev, None)
            return f"error event: {problem}: {json.dumps(ev)[:300]}" if problem else None
        if t == "content_block_start":
            if open_index is not None or ev.get("index") != next_index:
                return f"content_block_start {ev.get('index')!r} (open {open_index}, next {next_index})"
            open_index, next_index = next_index, next_index + 1
        elif t in ("content_block_delta", "content_block_stop"):
            if open_index is None or ev.get("index") != open_index:
                return f"{t} {ev.get('index')!r} while block {open_index} is open"
            if t == "content_block_stop":
                open_index = None
        elif t == "message_delta":
            deltas += 1
            if open_index is not None:
                return f"message_delta while block {open_index} is open"
        elif t != "message_stop":
            return f"unknown event {t!r}"
    if evs[-1]["type"] != "message_stop" or deltas != 1:
        return f"stream ended without its final event ({deltas} message_delta): {json.dumps(evs[-1])[:200]}"
    return None


def stream_problem(route: str, text: str) -> str | None:
    """Why an event stream is broken or incomplete (None when it is whole), as ``route``'s
    dialect streams."""
    if dialect(route) == "responses":
        return responses_stream_problem(text)
    if dialect(route) == "anthropic":
        return anthropic_stream_problem(text)
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
        return envelope_problem(status, r.text, dialect(case.route))
    if "text/event-stream" in ctype:
        return stream_problem(case.route, r.text)
    if case.route == "/":
        return page_problem(case, r)
    if "json" in ctype:
        try:
            body = strict_json(r.text)
        except ValueError as e:
            return f"2xx body is not JSON ({e}): {r.text[:200]!r}"
        return body_problem(case, body)
    return None


def body_problem(case: Case, body) -> str | None:
    """The shape of a 2xx JSON answer where the dialect fixes it (None elsewhere)."""
    want = None
    if case.route == fuzz_bodies.RESPONSES and case.method == "POST":
        ok = isinstance(body, dict) and body.get("object") == "response" and \
            body.get("status") in ("completed", "incomplete")
        want = "a completed or incomplete response object"
    elif case.route == fuzz_bodies.MESSAGES:
        ok = isinstance(body, dict) and body.get("type") == "message" and isinstance(body.get("content"), list)
        want = "a message object"
    elif case.route == fuzz_bodies.COUNT_TOKENS:
        ok = isinstance(body, dict) and list(body) == ["input_tokens"] and type(body["input_tokens"]) is int
        want = '{"input_tokens": int}'
    else:
        return None
    return None if ok else f"2xx body is not {want}: {json.dumps(body)[:200]}"


def page_problem(case: Case, r: httpx.Response) -> str | None:
    """GET /: the page (text/html) for an Accept naming text/html, else ``Ollama is running``."""
    want = {tuple(h.items()): w for h, w in fuzz_bodies.ACCEPTS}.get(tuple(case.headers.items()))
    html = r.headers.get("content-type", "").startswith("text/html")
    if r.status_code != 200 or (not html and r.text != "Ollama is running"):
        return f"GET / answered {r.status_code} {r.headers.get('content-type')}: {r.text[:100]!r}"
    if want is not None and html != (want == "html"):
        return f"GET / with {case.headers} answered {r.headers.get('content-type')} (want {want})"
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
    response_ids: list[str] = field(default_factory=list)  # stored responses seen, newest last (<= 8)

    def with_real_id(self, case: Case) -> Case:
        """``case`` with :data:`fuzz_bodies.REAL_ID` (in its path and body) replaced by the id of a
        response stored earlier in the run (as it is while none is)."""
        if not self.response_ids or (REAL_ID not in case.path and REAL_ID.encode() not in case.body):
            return case
        rid = self.response_ids[self.n_sent % len(self.response_ids)]
        return replace(case, path=case.path.replace(REAL_ID, rid),
                       body=case.body.replace(REAL_ID.encode(), rid.encode()))

    def note_ids(self, case: Case, r: httpx.Response) -> None:
        """Keep the id of a stored response (from a 2xx POST /v1/responses, streamed or not);
        forget one that was deleted."""
        if case.route == "/v1/responses/{id}" and case.method == "DELETE" and r.status_code == 200:
            gone = case.path.rsplit("/", 1)[-1]
            self.response_ids = [i for i in self.response_ids if i != gone]
        if case.route != RESPONSES or r.status_code != 200:
            return
        try:
            if "text/event-stream" in r.headers.get("content-type", ""):
                resp = strict_json(named_events(r.text)[0][1])["response"]
            else:
                resp = strict_json(r.text)
            if resp.get("store") and isinstance(resp.get("id"), str):
                self.response_ids = (self.response_ids + [resp["id"]])[-8:]
        except (ValueError, LookupError, TypeError, AttributeError):
            pass  # a broken answer is reported by check_response

    def send(self, case: Case) -> None:
        if self.stopped or self.n_hung >= MAX_HANGS:
            return
        case = self.with_real_id(case)
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
        self.note_ids(case, r)
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


def _sse(*events: dict, named: bool = True) -> str:
    return "".join((f"event: {ev['type']}\n" if named else "") + f"data: {json.dumps(ev)}\n\n" for ev in events)


def test_dialect_checks_catch_broken_answers():
    """The Responses and Messages checks pass whole answers and name what breaks the others."""
    created = {"type": "response.created", "sequence_number": 0, "response": {"status": "in_progress"}}
    done = {"type": "response.completed", "sequence_number": 1, "response": {"status": "completed"}}
    assert responses_stream_problem(_sse(created, done)) is None
    failed = {**done, "type": "response.failed", "response": {"status": "failed",
                                                               "error": {"code": "server_error", "message": "x"}}}
    assert "server fault" in responses_stream_problem(_sse(created, failed))
    assert responses_stream_problem(_sse(created, {**failed, "response": {
        "status": "failed", "error": {"code": "invalid_request_error", "message": "x"}}})) is None
    assert "final event" in responses_stream_problem(_sse(created))
    assert "[DONE]" in responses_stream_problem(_sse(created, done) + "data: [DONE]\n\n")
    assert "sequence_number" in responses_stream_problem(_sse(created, {**done, "sequence_number": 2}))
    assert "event None" in responses_stream_problem(_sse(created, done, named=False))
    assert "holds" in responses_stream_problem(_sse(created, {**done, "response": {"status": "failed"}}))

    start, stop = {"type": "message_start", "message": {}}, {"type": "message_stop"}
    block = [{"type": "content_block_start", "index": 0}, {"type": "ping"},
             {"type": "content_block_delta", "index": 0}, {"type": "content_block_stop", "index": 0}]
    delta = {"type": "message_delta", "delta": {}}
    assert anthropic_stream_problem(_sse(start, *block, delta, stop)) is None
    assert "final event" in anthropic_stream_problem(_sse(start, *block, delta))
    assert "final event" in anthropic_stream_problem(_sse(start, *block, stop))
    assert "is open" in anthropic_stream_problem(_sse(start, *block[:3], delta, stop))
    assert "content_block_start 1" in anthropic_stream_problem(_sse(start, {**block[0], "index": 1}))
    fault = {"type": "error", "error": {"type": "api_error", "message": "x"}}
    assert "api_error" in anthropic_stream_problem(_sse(start, fault))
    assert anthropic_stream_problem(_sse(start, {**fault, "error": {"type": "overloaded_error",
                                                                    "message": "x"}})) is None
    assert "starts with" in anthropic_stream_problem(_sse(*block, delta, stop))

    bad = '{"type":"error","error":{"type":"invalid_request_error","message":"m"}}'
    assert envelope_problem(400, bad, "anthropic") is None
    assert "for status 404" in envelope_problem(404, bad, "anthropic")
    assert envelope_problem(400, '{"error":{"code":400,"message":"m","type":"t"}}', "anthropic")
    assert envelope_problem(400, bad, "openai")
    assert "malformed" in envelope_problem(400, bad.replace('"m"}', '"m","code":400}'), "anthropic")

    messages = Case("POST", fuzz_bodies.MESSAGES, fuzz_bodies.MESSAGES)
    assert body_problem(messages, {"type": "message", "content": []}) is None
    assert body_problem(messages, {"type": "error"})
    count = Case("POST", fuzz_bodies.COUNT_TOKENS, fuzz_bodies.COUNT_TOKENS)
    assert body_problem(count, {"input_tokens": 3}) is None
    assert body_problem(count, {"input_tokens": 3.0})
    resp = Case("POST", RESPONSES, RESPONSES)
    assert body_problem(resp, {"object": "response", "status": "incomplete"}) is None
    assert body_problem(resp, {"object": "response", "status": "failed"})

    def page(ctype: str, text: str, accept: dict) -> str | None:
        r = httpx.Response(200, text=text, headers={"content-type": ctype})
        return page_problem(Case("GET", "/", "/", headers=accept), r)

    assert page("text/html; charset=utf-8", "<html>", {"Accept": "text/html"}) is None
    assert page("text/plain; charset=utf-8", "Ollama is running", {"Accept": "*/*"}) is None
    assert "want html" in page("text/plain; charset=utf-8", "Ollama is running", {"Accept": "text/html"})
    assert "want plain" in page("text/html; charset=utf-8", "<html>", {})
    assert page("text/plain", "nope", {})
