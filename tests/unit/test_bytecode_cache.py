"""kvserve.bytecode_cache: kvserve's modules compiled once and kept under $KVSERVE_HOME/cache/bytecode when
Python writes no .pyc files; an entry is used only for the source it was compiled from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import bytecode_cache as bc

ROOT = str(Path(__file__).resolve().parents[2])


def _loader(tmp_path, source: Path):
    loader = bc.CachingSourceLoader("kvserve_bc_probe", str(source))
    loader.directory = str(tmp_path / "cache")
    return loader


def _run(code_of, loader):
    ns: dict = {}
    exec(code_of(loader), ns)
    return ns["VALUE"]


def test_compiled_once_then_read_back(tmp_path, monkeypatch):
    src = tmp_path / "probe.py"
    src.write_text("VALUE = [i * i for i in range(4)]\n")
    loader = _loader(tmp_path, src)
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == [0, 1, 4, 9]
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.name.startswith("probe-") and entry.name.endswith(".bin")

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(bc.CachingSourceLoader, "source_to_code", no_compile)
    code = loader.get_code("kvserve_bc_probe")
    assert code.co_filename == str(src) and _run(lambda ld: code, loader) == [0, 1, 4, 9]


def test_a_changed_source_is_compiled_again(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("VALUE = 1\n")
    loader = _loader(tmp_path, src)
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 1
    st = src.stat()
    src.write_text("VALUE = 2\n")  # same size: only the modification time tells
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 2
    src.write_text("VALUE = 333\n")  # another size, the old time
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 333
    assert len(list((tmp_path / "cache").iterdir())) == 1  # rewritten in place, no temporary left


@pytest.mark.parametrize("damage", [b"", b"garbage", None])
def test_a_damaged_entry_is_compiled_again(tmp_path, damage):
    src = tmp_path / "probe.py"
    src.write_text("VALUE = 'ok'\n")
    loader = _loader(tmp_path, src)
    loader.get_code("kvserve_bc_probe")
    (entry,) = (tmp_path / "cache").iterdir()
    data = entry.read_bytes()
    entry.write_bytes(data[:-5] if damage is None else damage)  # truncated, empty, foreign
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == "ok"
    assert entry.read_bytes() == data


def test_an_unwritable_cache_costs_only_the_speed_up(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("VALUE = 5\n")
    (tmp_path / "cache").write_text("a file where the directory should be")
    loader = _loader(tmp_path, src)
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 5


def _child(tmp_path, *flags, env=None):
    code = ("import sys, kvserve, kvserve.serving.flags as f; from kvserve import bytecode_cache as bc; "
            "print(any(isinstance(x, bc.KvserveBytecodeFinder) for x in sys.meta_path), "
            "type(f.__spec__.loader).__name__, len(f.FLAGS) > 100)")
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSERVE_CACHE_DIR": str(tmp_path / "c"), **(env or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_process_that_writes_no_bytecode_uses_the_cache(tmp_path):
    # an empty pycache prefix: __pycache__ files that a checkout may hold (CI writes them) are not seen
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "no-pyc")}
    assert _child(tmp_path, "-B", env=env) == ["True", "CachingSourceLoader", "True"]
    names = {p.name.split("-")[0] for p in (tmp_path / "c" / "bytecode").iterdir()}
    assert {"flags", "request", "__init__"} <= names
    assert _child(tmp_path, "-B", env=env) == ["True", "CachingSourceLoader", "True"]  # read back


def test_off_when_python_writes_bytecode_or_when_asked(tmp_path):
    assert _child(tmp_path, "-B", env={"KVSERVE_BYTECODE_CACHE": "0"})[:2] == ["False", "SourceFileLoader"]
    assert not (tmp_path / "c" / "bytecode").exists()
    off = _child(tmp_path, env={"PYTHONPYCACHEPREFIX": str(tmp_path / "pyc")})  # Python's own .pyc files serve
    assert off[:2] == ["False", "SourceFileLoader"]
    assert not (tmp_path / "c" / "bytecode").exists()


def test_an_entry_that_is_not_code_is_compiled_again(tmp_path):
    import marshal

    src = tmp_path / "probe.py"
    src.write_text("VALUE = 7\n")
    loader = _loader(tmp_path, src)
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 7
    (entry,) = (tmp_path / "cache").iterdir()
    entry.write_bytes(bc._header(src.stat()) + marshal.dumps(42))
    assert _run(lambda ld: ld.get_code("kvserve_bc_probe"), loader) == 7


def test_a_fifo_entry_does_not_hang_the_import(tmp_path):
    import threading

    src = tmp_path / "probe.py"
    src.write_text("VALUE = 7\n")
    loader = _loader(tmp_path, src)
    entry = Path(bc.entry_path(loader.directory, str(src)))
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    got = []
    t = threading.Thread(target=lambda: got.append(_run(lambda ld: ld.get_code("kvserve_bc_probe"), loader)),
                         daemon=True)
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:  # let the stuck open() return so the thread ends
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert (hung, got) == (False, [7])
