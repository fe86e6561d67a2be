"""Run llama.cpp's own server tests (``tools/server/tests`` of a llama.cpp source tree, e.g. the
llama-cpp-python sdist's ``vendor/llama.cpp``) against kvserve, or against the real llama-server,
offline, on the default model (SmolLM2).

The suite's ``utils.py`` starts the program named by ``LLAMA_SERVER_BIN_PATH`` with llama-server's
flags; :func:`write_wrapper` writes one that runs ``python -m kvserve serve`` (or a llama-server
binary) with the same flags, its model flags (``--hf-repo``, ``--hf-file``, ``--model``,
``--model-url``) replaced by the default model's file. The suite imports ``wget`` (only to download
models, which never happens here): a module that refuses is put on its path.

Most of the suite's expected texts and token counts are those of its own tiny models, so what
kvserve must pass is what llama-server itself passes with the same SmolLM2 file:
:data:`LLAMA_SERVER_PASSES` (``tests/reference/llama_cpp_suite/llama_server_passes.json``),
recorded by running the suite against the real llama-server. Usage as a script::

    python tests/llama_cpp_suite.py [SUITE_DIR] [test_x.py ...] [pytest args...]   # against kvserve
    python tests/llama_cpp_suite.py --record-llama-server BIN [SUITE_DIR] [test_x.py ...]
        # record llama-server's passes, for the files named (default: all of SUITE_FILES); files not run
        # keep their earlier record
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the suite's files for the features kvserve implements (basic, chat, completion, security,
#: template, tokenize, metrics, tool calls, sleeping, Vertex AI's predict route, Anthropic's Messages API,
#: the server tools, the /cors-proxy, MCP servers)
SUITE_FILES = ("test_basic.py", "test_chat_completion.py", "test_completion.py", "test_security.py",
               "test_template.py", "test_tokenize.py", "test_metrics.py", "test_tool_call.py",
               "test_sleep.py", "test_compat_gcp.py", "test_compat_anthropic.py",
               "test_tools_builtin.py", "test_proxy.py", "test_mcp_servers.py")

#: the test ids (``unit/FILE::NAME``) llama-server passed on the default model, by file (see
#: :func:`record_llama_server`)
LLAMA_SERVER_PASSES = REPO / "tests" / "reference" / "llama_cpp_suite" / "llama_server_passes.json"

#: the pytest selection the suite's tests.sh uses by default
NOT_SLOW = ["-m", "not slow"]

_MODEL_FLAGS = ("--hf-repo", "-hfr", "--hf-file", "-hff", "--model", "-m", "--model-url", "-mu")

_WRAPPER = '''#!{python}
import os, sys
argv, skip = [], False
for a in sys.argv[1:]:
    if skip:
        skip = False
    elif a in {flags!r}:
        skip = True
    elif a != "--offline":
        argv.append(a)
server = {server!r}
if server:
    os.execv(server, [server, "--model", {model!r}, *argv])
os.environ["PYTHONPATH"] = {repo!r}
os.execv(sys.executable, [sys.executable, "-m", "kvserve", "serve", "--model", {model!r}, *argv])
'''


def find_suite() -> Path | None:
    """The suite's directory, ``$KVSERVE_LLAMA_CPP_TESTS`` (``tools/server/tests`` of an unpacked
    llama-cpp-python sdist), else None: opt-in only, as the run takes about 35 minutes on 2 cores
    and its server listens on the suite's fixed port 8080 (``$PORT`` moves it), so the default test
    run never starts it."""
    env = os.environ.get("KVSERVE_LLAMA_CPP_TESTS")
    if env and (Path(env) / "utils.py").is_file():
        return Path(env)
    return None


def write_wrapper(directory: Path, model: str, server: str | None = None) -> Path:
    """Write the ``LLAMA_SERVER_BIN_PATH`` program (and the refusing ``wget`` module) into
    ``directory``: it runs kvserve, or the llama-server binary ``server`` when given, on ``model``
    (a GGUF path) with the suite's other flags; returns the program's path."""
    directory.mkdir(parents=True, exist_ok=True)
    prog = directory / "llama-server"
    prog.write_text(_WRAPPER.format(python=sys.executable, flags=_MODEL_FLAGS, repo=str(REPO), model=model,
                                    server=server or ""))
    prog.chmod(0o755)
    (directory / "wget.py").write_text(
        "def download(url, out=None, bar=None):\n    raise RuntimeError(f'offline: will not download {url}')\n")
    return prog


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test's outcome in a pytest JUnit XML report: ``{"unit/test_x.py::test_y[p]":
    "passed" | "failed" | "error" | "skipped"}``."""
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        test_id = module.replace(".", "/") + ".py::" + case.get("name", "")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        out[test_id] = outcome
    return out


def run_suite(suite: Path, model: str, workdir: Path, extra: list[str] | None = None,
              timeout_s: float = 5400, server: str | None = None,
              files: tuple[str, ...] = SUITE_FILES) -> tuple[dict[str, str], str]:
    """Run ``files`` (of :data:`SUITE_FILES`) of ``suite`` in one pytest session against kvserve, or
    the llama-server binary ``server``; returns (each test's outcome as :func:`junit_outcomes`,
    pytest's output)."""
    prog = write_wrapper(workdir, model, server)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(prog), "PYTHONPATH": str(workdir),
           "LLAMA_CACHE": str(workdir / "cache"), "HF_HUB_OFFLINE": "1"}
    paths = [f"unit/{f}" for f in files if (suite / "unit" / f).is_file()]
    report = workdir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
           f"--junitxml={report}", f"--basetemp={workdir / 'pytest'}", *paths, *(extra or [])]
    p = subprocess.run(cmd, cwd=suite, env=env, capture_output=True, text=True, timeout=timeout_s)
    outcomes = junit_outcomes(report) if report.is_file() else {}
    return outcomes, p.stdout + p.stderr


def by_file(test_ids) -> dict[str, list[str]]:
    """Test ids grouped by their file (``test_x.py``), each list sorted."""
    out: dict[str, list[str]] = {}
    for t in sorted(test_ids):
        out.setdefault(t.split("::", 1)[0].rsplit("/", 1)[-1], []).append(t)
    return out


def load_llama_server_passes() -> dict[str, list[str]]:
    """:data:`LLAMA_SERVER_PASSES`: the test ids llama-server passed, by file."""
    return json.loads(LLAMA_SERVER_PASSES.read_text())["passed"]


def record_llama_server(suite: Path, model: str, server: str, workdir: Path,
                        files: tuple[str, ...] = SUITE_FILES) -> dict:
    """Run ``files`` of the suite (``-m "not slow"``) against the llama-server binary ``server`` and
    merge their passes into :data:`LLAMA_SERVER_PASSES` (the files run replace their earlier record,
    the others keep theirs); returns what was written."""
    outcomes, out = run_suite(suite, model, workdir, NOT_SLOW, server=server, files=files)
    if not outcomes:
        raise RuntimeError("no JUnit report: " + out[-2000:])
    v = subprocess.run([server, "--version"], capture_output=True, text=True)
    version = (v.stdout + v.stderr).strip().splitlines()
    old = json.loads(LLAMA_SERVER_PASSES.read_text()) if LLAMA_SERVER_PASSES.is_file() else {}
    ran = by_file(outcomes)
    passed = by_file(t for t, o in outcomes.items() if o == "passed")
    counts = {f: c for f, c in old.get("counts", {}).items() if f not in ran}
    counts.update({f: {"passed": len(passed.get(f, [])), "run": len(ids)} for f, ids in ran.items()})
    kept = {f: ids for f, ids in old.get("passed", {}).items() if f not in ran}
    record = {
        "about": "tests of llama.cpp's tools/server/tests that the real llama-server passed with the default "
                 "model's file in place of the suite's models (-m 'not slow'); regenerate with "
                 "python tests/llama_cpp_suite.py --record-llama-server BIN SUITE_DIR [test_x.py ...]",
        "llama_server": [line for line in version if line.startswith("version")][:1],
        "model": Path(model).name,
        "counts": dict(sorted(counts.items())),
        "passed": dict(sorted({**kept, **{f: ids for f, ids in passed.items()}}.items())),
    }
    LLAMA_SERVER_PASSES.parent.mkdir(parents=True, exist_ok=True)
    LLAMA_SERVER_PASSES.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(REPO))
    from kvserve.store import resolve_model

    args = sys.argv[1:]
    record_bin = None
    if args[:1] == ["--record-llama-server"]:
        record_bin = args[1]
        args = args[2:]
    suite = Path(args.pop(0)) if args and not args[0].startswith("-") else find_suite()
    if suite is None:
        sys.exit("no llama.cpp server test suite found (set KVSERVE_LLAMA_CPP_TESTS)")
    smollm2 = str(resolve_model("smollm2"))
    with tempfile.TemporaryDirectory() as d:
        if record_bin is not None:
            files = tuple(a for a in args if a.endswith(".py")) or SUITE_FILES
            rec = record_llama_server(suite, smollm2, record_bin, Path(d), files)
            print(json.dumps(rec["counts"], indent=1))
            sys.exit(0)
        files = tuple(a for a in args if a in SUITE_FILES) or SUITE_FILES
        outcomes, out = run_suite(suite, smollm2, Path(d), [a for a in args if a not in files], files=files)
    print(out)
    missing = {t for f, ids in load_llama_server_passes().items() if f in files for t in ids} - \
        {t for t, o in outcomes.items() if o == "passed"}
    print(f"kvserve on llama.cpp's server tests: {sum(o == 'passed' for o in outcomes.values())} passed of "
          f"{len(outcomes)}; passed by llama-server, not by kvserve: {len(missing)}")
    for t in sorted(missing):
        print("  ", t, outcomes.get(t, "not run"))
