"""Start-up and memory (issue #29): the GGUF weights read before they are needed
(kvserve.loaders.weight_read: ``kvserve serve`` starts the read before its imports, the loader takes it
over), and the C heap's free memory given back (kvserve.engine.heap: after a load, when the engine idles)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tinymodel
from kvserve.engine import heap
from kvserve.loaders import gguf as gl
from kvserve.loaders import weight_read as wr

ROOT = Path(__file__).resolve().parents[2]
HUGE = 2 << 20


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("KVSERVE_MMAP", raising=False)
    wr.release()
    yield
    wr.release()


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    """A random-weight GGUF of ~9 MiB (several 2 MiB pages, more than one 32 MiB piece's worth when
    PIECE is made small)."""
    return tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("wr") / "m.gguf", n_embd=512, n_ff=1536,
                                     n_layer=4, qtype="Q8_0", seed=7)


def _anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [lo, hi)."""
    total, cur = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            cur = a < hi and b > lo
        elif cur and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_prefetch_then_load_gives_the_files_bytes_in_aligned_huge_pages(big_gguf, monkeypatch):
    monkeypatch.setattr(wr, "PIECE", 1 << 20)  # many pieces: the prefetch thread and the loader share them
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "auto")
    if not wr.thp_available():
        pytest.skip("the kernel grants no transparent huge pages here: no prefetch")
    assert wr.prefetch(str(big_gguf)) is True
    assert wr.pending() == [os.path.realpath(big_gguf)]
    loaded = gl.load_gguf(big_gguf)
    assert wr.pending() == []  # claimed
    data = Path(big_gguf).read_bytes()
    _, infos = gl.read_gguf_header(str(big_gguf))
    raws = [(t, loaded.weights[t.name].raw) for t in infos if loaded.weights[t.name].raw is not None]
    assert len(raws) >= 4 * 7
    for t, raw in raws:
        assert raw.tobytes() == data[t.offset: t.offset + t.n_bytes], t.name
        assert not raw.flags.writeable
        assert (raw.ctypes.data - t.offset) % HUGE == 0  # at its file offset in a 2 MiB-aligned buffer
    base = raws[0][1].ctypes.data - raws[0][0].offset
    assert _anon_huge_kib(base, base + len(data)) >= 2048  # at least the whole 2 MiB pages are huge


def test_claim_refuses_a_file_replaced_after_the_prefetch_began(tmp_path, big_gguf, monkeypatch):
    """The file is replaced (rename over it) between the prefetch and the load: the loader reads the
    new file, never the prefetched bytes."""
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "auto")
    if not wr.thp_available():
        pytest.skip("no transparent huge pages: no prefetch")
    p = tmp_path / "m.gguf"
    p.write_bytes(Path(big_gguf).read_bytes())
    os.utime(p, ns=(1, 1))
    assert wr.prefetch(str(p))
    other = tinymodel.write_tiny_gguf(tmp_path / "n.gguf", n_embd=512, n_ff=1536, n_layer=4, qtype="Q8_0", seed=8)
    os.replace(other, p)
    assert wr.claim(str(p)) is None and wr.pending() == []
    assert wr.prefetch(str(p))
    os.replace(tinymodel.write_tiny_gguf(tmp_path / "o.gguf", n_embd=512, n_ff=1536, n_layer=4, qtype="Q8_0",
                                         seed=9), p)
    loaded = gl.load_gguf(p)
    data = p.read_bytes()
    _, infos = gl.read_gguf_header(str(p))
    t = next(t for t in infos if t.name == "blk.3.ffn_down.weight")
    assert loaded.weights[t.name].raw.tobytes() == data[t.offset: t.offset + t.n_bytes]


def test_prefetch_declines_what_it_should_not_read(tmp_path, big_gguf, monkeypatch):
    text = tmp_path / "notes.gguf"
    text.write_bytes(b"not a gguf file" * 100)
    assert wr.prefetch(str(text)) is False
    assert wr.prefetch(str(tmp_path / "missing.gguf")) is False
    assert wr.prefetch(str(tmp_path)) is False  # a folder: the server's own resolution decides
    monkeypatch.setenv("KVSERVE_MMAP", "1")  # --mmap: the weights stay the file's mapping
    assert wr.prefetch(str(big_gguf)) is False
    monkeypatch.delenv("KVSERVE_MMAP")
    monkeypatch.setattr(wr, "_mem_available", lambda: 2 * os.path.getsize(big_gguf) - 1)
    assert wr.prefetch(str(big_gguf)) is False  # not under half of MemAvailable
    assert wr.pending() == []


def test_unclaimed_prefetch_is_released_at_the_end_of_start_up(big_gguf):
    if not wr.thp_available():
        pytest.skip("no transparent huge pages: no prefetch")
    from kvserve import startup

    assert wr.prefetch(str(big_gguf))
    startup.resume()
    assert wr.pending() == []


def test_model_path_from_argv():
    assert wr.model_path_from_argv(["m.gguf", "-np", "1"]) == "m.gguf"
    assert wr.model_path_from_argv(["-np", "1", "-m", "a.gguf"]) == "a.gguf"
    assert wr.model_path_from_argv(["--model=b.gguf", "-c", "64"]) == "b.gguf"
    assert wr.model_path_from_argv(["-np", "1", "x.gguf"]) is None  # the flags' parser decides
    assert wr.model_path_from_argv([]) is None


def test_prefetch_for_argv_follows_the_mmap_flags(big_gguf, monkeypatch):
    if not wr.thp_available():
        pytest.skip("no transparent huge pages: no prefetch")
    assert wr.prefetch_for_argv([str(big_gguf), "--mmap"]) is False
    assert wr.prefetch_for_argv([str(big_gguf), "--no-preload"]) is False
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    assert wr.prefetch_for_argv([str(big_gguf)]) is False
    assert wr.prefetch_for_argv([str(big_gguf), "--no-mmap"]) is True  # the flag wins over the environment


def test_read_falls_back_when_madvise_fails(big_gguf, monkeypatch):
    """A kernel without THP (madvise EINVAL, a stand-in: this machine has THP): the copy still loads."""
    class NoThp(mmap.mmap):
        def madvise(self, *a):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", NoThp)
    r = wr.WeightRead(str(big_gguf), 4096)
    r.finish(2)
    view = r.result(4096)
    data = Path(big_gguf).read_bytes()
    assert bytes(view[4096:]) == data[4096:] and len(view) == len(data)


def test_a_cut_file_reads_short(tmp_path, big_gguf):
    p = tmp_path / "cut.gguf"
    data = Path(big_gguf).read_bytes()
    p.write_bytes(data)
    r = wr.WeightRead(str(p), 0)
    os.truncate(p, len(data) - 5000)
    r.finish(1)
    assert len(r.result(0)) == len(data) - 5000


def test_serve_starts_with_the_prefetch_and_frees_nothing_it_uses(big_gguf):
    """``kvserve serve FILE``: the CLI's prefetch is claimed by the start-up load (none pending after)
    and the server answers."""
    code = (
        "import sys, threading\n"
        "from kvserve.loaders import weight_read as wr\n"
        "from kvserve.engine import heap\n"
        f"ok = wr.prefetch_for_argv([{str(big_gguf)!r}, '-c', '64'])\n"
        "from kvserve.loaders import gguf\n"
        f"m = gguf.load_gguf({str(big_gguf)!r})\n"
        "print(ok == wr.thp_available(), wr.pending(), heap.trim() in (True, False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "True [] True"


_TRIM = r"""
import ctypes, json
from pathlib import Path
from kvserve.engine import heap

def rss_kib():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")).split()[1])

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 1 MiB chunks come from the heap (as once glibc's threshold has grown)
before = rss_kib()
chunks = [libc.malloc(1 << 20) for _ in range(129)]
for p in chunks:
    ctypes.memset(p, 1, 1 << 20)
bufs = chunks[0:128:2]  # every other one: freed, none merges with another or with the heap's top
grown = rss_kib()
for p in bufs:
    libc.free(p)
freed = rss_kib()
heap.trim()
print(json.dumps([grown - before, freed - before, rss_kib() - before]))
"""


def test_heap_trim_gives_back_freed_buffers():
    """64 MiB of C-heap buffers (between live ones), freed, stay resident until :func:`heap.trim`; after
    it the resident set is 64 MiB smaller (a child process: mallopt there only)."""
    if heap._malloc_trim() is None:
        pytest.skip("no malloc_trim (not glibc)")
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    grown, freed, trimmed = json.loads(out.stdout)
    assert grown >= 128 * 1024 and freed > grown - 2048  # free() alone keeps them resident
    assert freed - trimmed >= 63 * 1024  # trim gives back all 64 MiB


def test_idle_engine_trims_once_after_work_and_never_while_busy(monkeypatch):
    import kvserve.engine.async_engine as ae
    from kvserve.engine.fake import fake_engine_core
    from kvserve.engine.request import Request, SamplingParams

    calls: list[float] = []
    monkeypatch.setattr(heap, "IDLE_TRIM_S", 0.3)
    monkeypatch.setattr(heap, "trim", lambda: calls.append(time.monotonic()) or True)
    eng = ae.AsyncEngine(fake_engine_core())
    try:
        time.sleep(0.5)
        assert calls == []  # idle since start: nothing to give back

        async def run(rid):
            outs = [o async for o in eng.generate(Request(rid, [1, 2, 3], SamplingParams(n_predict=8,
                                                                                          ignore_eos=True)))]
            return outs

        t_end = None
        for i in range(3):  # requests 0.1 s apart: no trim between them
            asyncio.run(run(f"r{i}"))
            t_end = time.monotonic()
            time.sleep(0.1)
        assert calls == []
        time.sleep(0.6)
        assert len(calls) == 1 and calls[0] - t_end >= 0.25
        time.sleep(0.5)
        assert len(calls) == 1  # once per idle period
    finally:
        eng.shutdown()


def test_tokenizer_error_comes_after_the_tensors_errors(tmp_path, monkeypatch):
    """The tokenizer is built while the weights are read (load_gguf): a file whose tokenizer cannot be
    built fails naming the tokenizer, and one that is also cut short fails naming the truncated tensor
    first, as when the two steps ran one after the other."""
    from kvserve.loaders.weights import ModelLoadError

    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "read")
    p = tinymodel.write_tiny_gguf(tmp_path / "t.gguf", n_embd=256, n_ff=512, qtype="Q8_0", seed=3,
                                  metadata={"tokenizer.ggml.pre": "no-such-pre-tokenizer"})
    with pytest.raises(ModelLoadError, match="cannot build tokenizer.*no-such-pre-tokenizer"):
        gl.load_gguf(p)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:-3000])
    with pytest.raises(ModelLoadError, match="truncated|not whole"):
        gl.load_gguf(cut)


def test_a_file_written_in_place_during_the_read_fails_the_load(tmp_path, big_gguf):
    """The file is rewritten in place (same inode: ``cp new old``) while its weights are read: the bytes
    read may mix the two files, so the load fails with a clear ModelLoadError naming the file (the
    identity, checked again once the read ended, on the descriptor the bytes came from), never loads them."""
    p = tmp_path / "m.gguf"
    p.write_bytes(Path(big_gguf).read_bytes())
    _, infos = gl.read_gguf_header(str(p))
    r = wr.WeightRead(str(p), min(t.offset for t in infos))
    with open(p, "r+b") as f:  # same inode, new bytes and a new modification time
        f.seek(infos[-1].offset)
        f.write(b"\x01" * 64)
    os.utime(p, ns=(10**9, 10**9))
    with pytest.raises(gl.ModelLoadError, match=r"m\.gguf.*changed while"):
        gl._finish_read(r, infos)
    # a file left alone reads as before
    r = wr.WeightRead(str(p), min(t.offset for t in infos))
    assert gl._finish_read(r, infos).tobytes()[infos[0].offset:] == p.read_bytes()[infos[0].offset:]


@pytest.mark.parametrize("env, want", [
    ({}, "1"), ({"KVSERVE_MALLOC_ARENAS": "1"}, "1"), ({"KVSERVE_MALLOC_ARENAS": "0"}, "default"),
    ({"KVSERVE_MALLOC_ARENAS": "false"}, "default"), ({"KVSERVE_MALLOC_ARENAS": " Off "}, "default"),
    ({"KVSERVE_MALLOC_ARENAS": "no"}, "default"), ({"KVSERVE_MALLOC_ARENAS": "4"}, "4"),
    ({"KVSERVE_MALLOC_ARENAS": "-3"}, "1"), ({"KVSERVE_MALLOC_ARENAS": "lots"}, "1"),
    ({"MALLOC_ARENA_MAX": "2"}, "default"), ({"MALLOC_ARENA_MAX": "2", "KVSERVE_MALLOC_ARENAS": "3"}, "3"),
])
def test_malloc_arenas_setting(env, want):
    """KVSERVE_MALLOC_ARENAS: 0 / false / off / no (any case, spaces: as KVSERVE_MMAP reads its words)
    keep glibc's default; N > 0 limits glibc to N arenas; unset, negative or not a number: one arena
    (a warning for the last two). glibc's own MALLOC_ARENA_MAX, when set and ours is not, is the user's
    choice and stays (mallopt would override it). Each case in a fresh process (mallopt is per process);
    mallopt itself is replaced by a recorder: the value asked for, or "default" when it is not called."""
    code = ("import ctypes, kvserve.engine.heap as h\n"
            "calls = []\n"
            "class L:\n"
            "    def __init__(self, *a): pass\n"
            "    @property\n"
            "    def mallopt(self):\n"
            "        def f(p, v): calls.append((p, v)); return 1\n"
            "        return f\n"
            "h.ctypes = type('C', (), {'CDLL': L, 'c_int': ctypes.c_int})\n"
            "ok = h.one_arena()\n"
            "assert ok == bool(calls), (ok, calls)\n"
            "print(calls[0][1] if calls else 'default')\n")
    e = {k: v for k, v in os.environ.items() if k not in ("KVSERVE_MALLOC_ARENAS", "MALLOC_ARENA_MAX")}
    e.update(env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want, (env, out.stdout, out.stderr)


def test_prefetch_for_argv_follows_llama_servers_load_mode(big_gguf, monkeypatch):
    """llama-server's ``-lm`` / ``--load-mode`` (and LLAMA_ARG_LOAD_MODE), which kvserve serve's
    parser maps to --mmap / --no-mmap (kvserve.serving.args): mmap and mmap+mlock start no read (the
    server maps the file: a read would only hold a second copy of it until start-up ends); none, mlock
    and dio read even where KVSERVE_MMAP=1 asks for the mapping; --mmap / --no-mmap (the last one given)
    win over it, as in the parser."""
    if not wr.thp_available():
        pytest.skip("no transparent huge pages: no prefetch")
    p = str(big_gguf)
    for argv in ([p, "-lm", "mmap"], [p, "--load-mode", "mmap+mlock"], [p, "--load-mode=mmap"],
                 [p, "--no-mmap", "--mmap"]):
        assert wr.prefetch_for_argv(argv) is False, argv
        assert wr.pending() == []
    monkeypatch.setenv("LLAMA_ARG_LOAD_MODE", "mmap")
    assert wr.prefetch_for_argv([p]) is False
    assert wr.prefetch_for_argv([p, "-lm", "none"]) is True  # the flag wins over its variable
    wr.release()
    assert wr.prefetch_for_argv([p, "--no-mmap", "-lm", "mmap"]) is True  # --no-mmap wins over -lm
    wr.release()
    monkeypatch.delenv("LLAMA_ARG_LOAD_MODE")
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    for argv in ([p, "-lm", "dio"], [p, "--load-mode=mlock"], [p, "--mmap", "--no-mmap"]):
        assert wr.prefetch_for_argv(argv) is True, argv
        wr.release()
    assert wr.prefetch_for_argv([p, "-lm", "auto"]) is False  # auto: KVSERVE_MMAP=1 decides
