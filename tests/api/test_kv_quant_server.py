"""A server started with quantized KV cache types (-ctk q8_0 -ctv q4_0, --kv-cache-dtype fp8) serves:
prefix-cache hits, slot save/erase/restore, a slot file of another KV type refused, vLLM's fp8 log line,
and the start-up error for a head_dim the blocks do not tile."""

import subprocess
import sys

import httpx
import pytest

import tinymodel
from servers import REPO

PROMPT = "hello world this is a test of the quantized cache and more words here"
BODY = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def h32(tmp_path_factory) -> str:
    """A tiny random model whose head_dim (32) q8_0/q4_0 blocks tile: 2 layers, 2 KV heads."""
    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("h32") / "h32.gguf", n_embd=128, n_head=4,
                                         n_head_kv=2, n_ff=256))


def _complete(srv) -> tuple[str, int, int]:
    d = httpx.post(srv.url("/completion"), json=BODY, timeout=60).json()
    return d["content"], d["timings"]["cache_n"], d["timings"]["prompt_n"]


def test_q8_0_k_q4_0_v_server_serves_hits_and_slot_files(start_server, h32, tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    srv = start_server("-ctk", "q8_0", "-ctv", "q4_0", "-np", "1", "--slot-save-path", str(slots), model=h32)
    text, cached, n = _complete(srv)
    assert (cached, n) == (0, 41)
    assert _complete(srv) == (text, 40, 1)  # a prefix hit on the quantized rows: the same answer
    r = httpx.post(srv.url("/slots/0?action=save"), json={"filename": "a.bin"}, timeout=60).json()
    # 48 tokens (41 + 8 - 1 fed back); per token 2 layers x 2 heads x 32 values x (34/32 + 18/32) bytes
    assert (r["n_saved"], r["n_written"]) == (48, 40 + 4 * 48 + 48 * 208)
    assert httpx.post(srv.url("/slots/0?action=erase"), json={}, timeout=60).json()["n_erased"] == 48
    r = httpx.post(srv.url("/slots/0?action=restore"), json={"filename": "a.bin"}, timeout=60).json()
    assert (r["n_restored"], r["n_read"]) == (48, 10216)
    assert _complete(srv) == (text, 40, 1)

    fp8 = start_server("--kv-cache-dtype", "fp8", "-np", "1", "--slot-save-path", str(slots), model=h32)
    assert ("Using fp8 data type to store kv cache. It reduces the GPU memory footprint and boosts the "
            "performance. Meanwhile, it may cause accuracy drop without a proper scaling factor") in fp8.log()
    assert _complete(fp8)[1:] == (0, 41)
    r = httpx.post(fp8.url("/slots/0?action=restore"), json={"filename": "a.bin"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "slot file KV dtype (K q8_0, V q4_0) differs from the cache's (K fp8_e4m3, V fp8_e4m3): restore it into a "
        "server started with -ctk q8_0 -ctv q4_0")


def test_head_dim_not_a_multiple_of_32_is_a_start_up_error(tmp_path):
    path = tinymodel.write_tiny_gguf(tmp_path / "h16.gguf")  # head_dim 16
    p = subprocess.run([sys.executable, "-m", "kvserve", "serve", str(path), "--host", "127.0.0.1", "--port", "0",
                        "-ctv", "q4_0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert ("KV cache type q4_0 needs the model's head_dim to be a multiple of 32 (blocks of 32 values); this "
            "model's head_dim is 16: use f16, bf16, f32 or fp8") in p.stdout + p.stderr
