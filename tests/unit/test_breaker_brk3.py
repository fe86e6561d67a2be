"""Breaker brk3: attacks on the session's changes (weights read into huge pages, xgrammar imported
without transformers, ...). Each test shows a defect found, fixed where the fix was small."""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinymodel

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter (this process may have imported xgrammar/transformers);
    returns the JSON of its last stdout line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- weights read into huge pages (kvserve.loaders.gguf._weight_bytes) ---------------------------------


class _NoThpMmap(mmap.mmap):
    """An anonymous mapping whose madvise fails as on a kernel built without transparent huge pages
    (CONFIG_TRANSPARENT_HUGEPAGE=n: madvise(MADV_HUGEPAGE) is EINVAL). A stand-in for such a kernel,
    which this machine is not."""

    def madvise(self, *args):
        raise OSError(errno.EINVAL, "Invalid argument")


def test_no_mmap_loads_where_madvise_hugepage_fails(tmp_path, monkeypatch):
    """--no-mmap / KVSERVE_MMAP=0 on a kernel without THP: madvise(MADV_HUGEPAGE) fails with EINVAL.
    Before: load_gguf raised that bare OSError (a crash at start-up); now the private copy loads on
    4 KiB pages, byte-equal to the file."""
    from kvserve.loaders import gguf as gl

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q4_K", seed=4)
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "read")
    monkeypatch.setattr(mmap, "mmap", _NoThpMmap)
    loaded = gl.load_gguf(path)
    data = Path(path).read_bytes()
    _, infos = gl.read_gguf_header(str(path))
    t = next(t for t in infos if t.name == "blk.0.attn_q.weight")
    raw = loaded.weights[t.name].raw
    assert raw.tobytes() == data[t.offset: t.offset + t.n_bytes]
    assert not isinstance(raw.base, np.memmap)


# -- xgrammar imported without transformers (kvserve.structured.xgr) ------------------------------------

_HALF = r'''
import json, sys, threading
from kvserve.structured.xgr import xgrammar_module
res = {}
def other():
    while "xgrammar" not in sys.modules:  # xgrammar's import has begun in the main thread
        pass
    res["complete"] = hasattr(xgrammar_module(), "GrammarCompiler")
t = threading.Thread(target=other)
t.start()
xgrammar_module()
t.join(60)
print(json.dumps(res))
'''


def test_xgrammar_module_never_returns_a_half_imported_module():
    """Two threads ask for xgrammar at once (the grammar warm-up thread and a first tool-call request).
    Before: the second got ``sys.modules["xgrammar"]`` while the first was still executing its
    ``__init__`` (no ``GrammarCompiler`` yet: AttributeError in a request); now it waits for the import."""
    assert _run(_HALF) == {"complete": True}


_CONCURRENT = r'''
import json, sys, threading
from kvserve.structured.xgr import xgrammar_module
res = {}
def other():
    while not isinstance(sys.modules.get("transformers"), type(sys)):  # the stand-in is installed
        pass
    import transformers
    res["auto"] = hasattr(transformers, "AutoTokenizer")
    res["fast_module"] = transformers.PreTrainedTokenizerFast.__module__
t = threading.Thread(target=other)
t.start()
xgr = xgrammar_module()
t.join(120)
res["compiler"] = hasattr(xgr, "GrammarCompiler")
res["real_after"] = hasattr(sys.modules.get("transformers"), "AutoTokenizer")
print(json.dumps(res))
'''


def test_import_transformers_while_the_stand_in_is_installed_gets_the_real_package():
    """Another thread of the process runs ``import transformers`` while xgrammar is being imported under
    the stand-in. Before: it got the stand-in (no ``AutoTokenizer``, placeholder classes) for good;
    now its attribute lookups wait for xgrammar's import and answer from the real package."""
    assert _run(_CONCURRENT) == {"auto": True, "fast_module": "transformers.tokenization_utils_tokenizers",
                                 "compiler": True, "real_after": True}


# -- MCP stdio servers under the reaper (kvserve/tools/mcp.py) ------------------------------------------


def test_mcp_server_that_crashes_leaving_a_child_on_its_stdout_ends_the_call_at_once(tmp_path):
    """A stdio server starts a child that keeps its stdout (a setsid grandchild, as many servers' helper
    daemons do), then crashes during a call. Before: no EOF on stdout, so the call waited for its whole
    timeout (30 s) and answered ``request timed out``; now the server's exit (the reaper's status pipe)
    ends the transport: ``transport closed`` within seconds; the next call starts the server again and
    the orphaned child is killed."""
    import asyncio
    import time

    sys.path.insert(0, str(ROOT / "tests" / "api"))
    from test_mcp_api import FX, _alive, _wait_gone

    from kvserve.tools import mcp as mcp_mod

    fx = tmp_path / "fx.py"
    fx.write_text(FX)

    async def run():
        m = mcp_mod.McpManager([mcp_mod.McpServerConfig("fx", command=sys.executable, args=[str(fx)],
                                                        env={"FX_NEW_SESSION": "1"})])
        try:
            await m.warm_up()
            server = int((await m.call_tool("fx", "pid", {}))["plain_text_response"])
            child = int((await m.call_tool("fx", "spawn", {}))["plain_text_response"])
            t0 = time.monotonic()
            crashed = await asyncio.wait_for(m.call_tool("fx", "crash", {}), 40)
            took = time.monotonic() - t0
            again = await m.call_tool("fx", "echo", {"message": "again"})
            return server, child, crashed, took, again
        finally:
            await m.aclose()

    server, child, crashed, took, again = asyncio.run(run())
    try:
        assert (crashed, again) == ({"error": "transport closed"}, {"plain_text_response": "echo: again"})
        assert took < 5, took
        assert _wait_gone([server, child], 5) == []
    finally:
        if _alive(child):
            os.kill(child, 9)


# -- every layer sliding (phi3) and the window groups (kvserve.engine.kv_budget.window_groups) ----------


@pytest.mark.parametrize("arch", ["phi3", "gpt_oss"])
def test_a_window_of_one_token_loads_and_equals_transformers(tmp_path, arch):
    """A sliding window of 1 (each query sees only its own key; transformers' mask allows it). Before:
    phi3 now giving its layers a sliding group, the engine refused the model at load
    (``ValueError: sliding window 1: at least 2 tokens`` from the group's pool; phi3 loaded on the
    masked path before this session; gpt-oss likewise refused). Now such a window keeps one pool,
    masked: the greedy tokens equal transformers'."""
    pytest.importorskip("transformers")
    import family_models as fmod

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.request import Request, SamplingParams
    from kvserve.models.build import load_files

    extra = dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2) if arch == "gpt_oss" else {}
    model = fmod.build(arch, seed=7, sliding_window=1, **extra)
    path = str(fmod.save_hf(model, tmp_path / "hf"))
    eog = sorted(load_files(path).tokenizer.eog_token_ids)
    prompt = [5, 77, 120, 33, 250, 9, 18, 260, 41, 199, 7, 88]
    core = EngineCore(load_files(path), EngineConfig(n_ctx=256, dtype="float32", kv_dtype="f32"))
    assert core.kv.groups == []
    core.add_request(Request("a", prompt, SamplingParams(n_predict=12, temperature=0.0, ignore_eos=True)))
    got = []
    while core.has_work():
        for o in core.step():
            got += o.new_token_ids
    assert got == fmod.reference_greedy(model, prompt, 12, eog)


def test_llama_servers_load_mode_picks_how_weights_are_held(monkeypatch):
    """llama-server of this tree has no --mmap: it spells the choice ``-lm/--load-mode`` (env
    LLAMA_ARG_LOAD_MODE: auto, none, mmap, mlock, mmap+mlock, dio). Before: kvserve accepted ``-lm``
    without effect ("weights are read into memory, not mapped", no longer true with --mmap), so
    ``-lm mmap`` still read the weights into private memory and ``-lm bogus`` passed silently. Now
    mmap / mmap+mlock act as --mmap, none / mlock / dio as --no-mmap, --mmap/--no-mmap win, and an
    unknown mode is refused as llama-server refuses it."""
    from kvserve.serving.args import parse_args

    assert parse_args([]).mmap is None
    assert [parse_args(["-lm", m]).mmap for m in ("auto", "mmap", "mmap+mlock", "none", "mlock", "dio")] == \
        [None, True, True, False, False, False]
    assert parse_args(["-lm", "mmap", "--no-mmap"]).mmap is False
    assert parse_args(["--load-mode", "none", "--mmap"]).mmap is True
    monkeypatch.setenv("LLAMA_ARG_LOAD_MODE", "mmap")
    assert parse_args([]).mmap is True
    monkeypatch.delenv("LLAMA_ARG_LOAD_MODE")
    with pytest.raises(SystemExit) as e:
        parse_args(["-lm", "bogus"])
    assert e.value.code == 2
