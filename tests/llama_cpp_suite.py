"""Run llama.cpp's own server tests (``tools/server/tests`` of a llama.cpp source tree, e.g. the
llama-cpp-python sdist's ``vendor/llama.cpp``) against kvserve, offline, on the default model.

The suite's ``utils.py`` starts the program named by ``LLAMA_SERVER_BIN_PATH`` with llama-server's
flags; :func:`write_wrapper` writes one that runs ``python -m kvserve serve`` with the same flags,
its model flags (``--hf-repo``, ``--hf-file``, ``--model``, ``--model-url``) replaced by the default
model's file. The suite imports ``wget`` (only to download models, which never happens here): a
module that refuses is put on its path. Usage as a script::

    python tests/llama_cpp_suite.py [SUITE_DIR] [pytest args...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the suite's files for the features kvserve implements (basic, chat, completion, security,
#: template, tokenize, metrics, tool calls)
SUITE_FILES = ("test_basic.py", "test_chat_completion.py", "test_completion.py", "test_security.py",
               "test_template.py", "test_tokenize.py", "test_metrics.py", "test_tool_call.py")

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
os.environ["PYTHONPATH"] = {repo!r}
os.execv(sys.executable, [sys.executable, "-m", "kvserve", "serve", "--model", {model!r}, *argv])
'''


def find_suite() -> Path | None:
    """The suite's directory, ``$KVSERVE_LLAMA_CPP_TESTS`` (``tools/server/tests`` of an unpacked
    llama-cpp-python sdist), else None: opt-in only, as the run takes about 35 minutes on 2 cores
    and its server listens on the suite's fixed port 8080, so the default test run never starts it."""
    env = os.environ.get("KVSERVE_LLAMA_CPP_TESTS")
    if env and (Path(env) / "utils.py").is_file():
        return Path(env)
    return None


def write_wrapper(directory: Path, model: str) -> Path:
    """Write the ``LLAMA_SERVER_BIN_PATH`` program (and the refusing ``wget`` module) into
    ``directory``; returns the program's path."""
    directory.mkdir(parents=True, exist_ok=True)
    prog = directory / "llama-server"
    prog.write_text(_WRAPPER.format(python=sys.executable, flags=_MODEL_FLAGS, repo=str(REPO), model=model))
    prog.chmod(0o755)
    (directory / "wget.py").write_text(
        "def download(url, out=None, bar=None):\n    raise RuntimeError(f'offline: will not download {url}')\n")
    return prog


def run_suite(suite: Path, model: str, workdir: Path, extra: list[str] | None = None,
              timeout_s: float = 3600) -> tuple[int, int, str]:
    """Run :data:`SUITE_FILES` of ``suite`` against kvserve; returns (passed, failed, output).
    ``failed`` counts failures and errors."""
    prog = write_wrapper(workdir, model)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(prog), "PYTHONPATH": str(workdir),
           "LLAMA_CACHE": str(workdir / "cache"), "HF_HUB_OFFLINE": "1"}
    files = [f"unit/{f}" for f in SUITE_FILES if (suite / "unit" / f).is_file()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *files, *(extra or [])]
    p = subprocess.run(cmd, cwd=suite, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = p.stdout + p.stderr
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", tail))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", tail))
    return passed, failed, out


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from kvserve.store import resolve_model

    args = sys.argv[1:]
    suite = Path(args.pop(0)) if args and not args[0].startswith("-") else find_suite()
    if suite is None:
        sys.exit("no llama.cpp server test suite found (set KVSERVE_LLAMA_CPP_TESTS)")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        passed, failed, out = run_suite(suite, str(resolve_model("smollm2")), Path(d), args)
    print(out)
    print(f"kvserve on llama.cpp's server tests: {passed} passed, {failed} failed")
