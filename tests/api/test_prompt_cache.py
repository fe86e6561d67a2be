"""Prompt caching through the server (real SmolLM2): seed 000 Examples 9, 10, 11, cross-slot
reuse, cache_salt, host-tier eviction, cache_miss and the accounting fields.

Expected numbers are computed with our tokenizer (pinned to llama.cpp's) and stated per line.
Equality of greedy outputs uses ``--dtype float32`` (no int4 kernel): then a cache hit and a
cold prefill run the same float32 math on the same f16-rounded K/V, and the tokens must match
exactly (the only difference is the batch shape of the matmuls, which on these prompts does
not flip an argmax; the tests assert exact equality).
"""

from __future__ import annotations

import httpx
import pytest

PRE = ("You are a careful Java reviewer. Read the code, list each bug with its line number, "
       "and suggest a fix. Keep answers short.")
Q1 = PRE + " Question: int x = 1/0;"
Q2 = PRE + " Question: String s = null; s.length();"
PASTA = "Unrelated text about cooking pasta."
HEADER = "File: Main.java\n"


def post(srv, path, body, status=200):
    r = httpx.post(srv.url(path), json=body, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def complete(srv, prompt, **kw):
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, **kw}
    return post(srv, "/completion", body)


def cn(res):
    t = res["timings"]
    return t["cache_n"], t["prompt_n"]


def ntok(tok, text):
    return len(tok.encode(text, add_special=True))


# -- Example 9 ---------------------------------------------------------------------------

@pytest.mark.parametrize("cache_ram", ["0", "8192"])
def test_seed_example_9(start_server, smollm2_tokenizer, cache_ram):
    """Five requests on slot 0 (-np 1).

    With our tokenization (SmolLM2's BPE, not the seed's Qwen2): Q1 has 38 tokens, Q2 39
    (the seed's 38), PASTA 7, and Q1/Q2 share 30 (the 28 instruction tokens + " Question"
    + ":"). Lines: (0, 38) (30, 9) (0, 39) (0, 7),
    then line 5: --cache-ram 0 -> (0, 38) (request 1's KV is gone); with the host tier ->
    (37, 1): llama-server's RAM cache holds request 3's state there (30 shared), our host
    tier still indexes request 1's own blocks, so all but the last token are reused.
    """
    tok = smollm2_tokenizer
    n1, n2, n4 = ntok(tok, Q1), ntok(tok, Q2), ntok(tok, PASTA)
    a, b = tok.encode(Q1, add_special=True), tok.encode(Q2, add_special=True)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert (n1, n2, n4, shared) == (38, 39, 7, 30)
    srv = start_server("-np", "1", "--cache-ram", cache_ram, "--metrics")
    lines = [
        complete(srv, Q1, id_slot=0),
        complete(srv, Q2, id_slot=0),
        complete(srv, Q2, id_slot=0, cache_prompt=False),
        complete(srv, PASTA, id_slot=0),
        complete(srv, Q1, id_slot=0),
    ]
    last = (0, 38) if cache_ram == "0" else (37, 1)
    assert [cn(r) for r in lines] == [(0, 38), (30, 9), (0, 39), (0, 7), last]
    assert [r["tokens_evaluated"] for r in lines] == [38, 39, 39, 7, 38]
    # cache_miss: why each request reused less than it could have
    assert "cache_miss" not in lines[0]["timings"]
    m = lines[1]["timings"]["cache_miss"]
    assert (m["reason"], m["first_diff_pos"], m["n_reused"]) == ("prefix differs", 30, 30)
    assert "String" in m["prompt_excerpt"] and "cached_excerpt" not in m  # no key, no salt: no cached text
    assert lines[2]["timings"]["cache_miss"]["reason"] == "cache_prompt false"
    assert "cache_miss" not in lines[3]["timings"]
    if cache_ram == "0":
        assert lines[4]["timings"]["cache_miss"]["reason"] == "evicted"
    else:
        assert "cache_miss" not in lines[4]["timings"]
    # accounting: cache_n + prompt_n == prompt tokens; metrics count processed and reused separately
    for r in lines:
        assert sum(cn(r)) == r["tokens_evaluated"]
        assert r["tokens_cached"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1
    text = httpx.get(srv.url("/metrics")).text
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    reused = 30 + last[0]
    assert vals["llamacpp:prompt_tokens_cached_total"] == reused
    assert vals["llamacpp:prompt_tokens_total"] == 38 + 39 + 39 + 7 + 38 - reused
    slots = httpx.get(srv.url("/slots")).json()
    assert slots[0]["n_prompt_tokens_cache"] == last[0]
    assert slots[0]["n_prompt_tokens_processed"] == last[1]


# -- Example 10 --------------------------------------------------------------------------

@pytest.mark.parametrize("reuse", [None, "8"])
def test_seed_example_10(start_server, smollm2_tokenizer, reuse):
    """The header is 6 tokens for SmolLM2 (File, :, " Main", ".", java, \n; the seed's Qwen2 has
    5), so the first prompt has 44 tokens and the second 38.
    A: --cache-ram 0 -np 1: (0, 44) then (0, 38). B: + --cache-reuse 8: (0, 44) then (37, 1)."""
    tok = smollm2_tokenizer
    a, b = tok.encode(HEADER + Q1, add_special=True), tok.encode(Q1, add_special=True)
    assert (len(a), len(b)) == (44, 38) and a[6:] == b  # the header is 6 whole tokens
    args = ["-np", "1", "--cache-ram", "0"] + (["--cache-reuse", reuse] if reuse else [])
    srv = start_server(*args)
    assert cn(complete(srv, HEADER + Q1)) == (0, 44)
    r = complete(srv, Q1)
    assert cn(r) == ((37, 1) if reuse else (0, 38))
    assert r["tokens_predicted"] == 2
    if not reuse:
        # per-request n_cache_reuse turns it on without the flag
        complete(srv, HEADER + Q1)
        assert cn(complete(srv, Q1, n_cache_reuse=8)) == (37, 1)


# -- Example 11 --------------------------------------------------------------------------

def test_seed_example_11_save_erase_restore(start_server, tmp_path):
    """PRE is 28 tokens, Q1 38. --cache-ram 0; an erase also drops the slot's blocks from the
    host tier (tests/api/test_hardening_slots.py checks that with the tier on)."""
    d = tmp_path / "slots"
    d.mkdir()
    srv = start_server("-np", "1", "--cache-ram", "0", "--slot-save-path", str(d))
    r = complete(srv, PRE, n_predict=0, id_slot=0)
    assert cn(r) == (0, 28)
    s = post(srv, "/slots/0?action=save", {"filename": "review-prefix2.bin"})
    assert (s["id_slot"], s["filename"], s["n_saved"]) == (0, "review-prefix2.bin", 28)
    assert s["n_written"] == (d / "review-prefix2.bin").stat().st_size and s["timings"]["save_ms"] >= 0
    assert post(srv, "/slots/0?action=erase", {}) == {"id_slot": 0, "n_erased": 28}
    assert cn(complete(srv, Q1, id_slot=0)) == (0, 38)
    assert post(srv, "/slots/0?action=erase", {}) == {"id_slot": 0, "n_erased": 39}
    view = httpx.get(srv.url("/slots")).json()[0]
    assert view["n_prompt_tokens"] == 0
    rr = post(srv, "/slots/0?action=restore", {"filename": "review-prefix2.bin"})
    assert (rr["n_restored"], rr["n_read"]) == (28, s["n_written"]) and "restore_ms" in rr["timings"]
    assert httpx.get(srv.url("/slots")).json()[0]["n_prompt_tokens"] == 28
    assert cn(complete(srv, Q1, id_slot=0)) == (28, 10)
    for bad in ("../etc/passwd", "a/b.bin", "..", "/etc/passwd"):
        e = post(srv, "/slots/0?action=restore", {"filename": bad}, status=400)
        assert e["error"]["message"] == "Invalid filename"
    e = post(srv, "/slots/0?action=restore", {"filename": "missing.bin"}, status=404)
    assert "not found" in e["error"]["message"]
    (d / "junk.bin").write_bytes(b"KVSLOT" + bytes(60))
    e = post(srv, "/slots/0?action=restore", {"filename": "junk.bin"}, status=400)
    assert "slot file" in e["error"]["message"]


def test_slot_actions_without_save_path_are_501(start_server):
    srv = start_server("-np", "1")
    post(srv, "/slots/0?action=save", {"filename": "x.bin"}, status=501)
    post(srv, "/slots/0?action=restore", {"filename": "x.bin"}, status=501)


# -- cross-slot, salts, eviction ---------------------------------------------------------

def long_prefix(tok, n=1000) -> str:
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
             "sigma tau upsilon phi chi psi omega").split()
    text, i = "", 0
    while ntok(tok, text) < n + 5:
        text += f"{words[i % len(words)]} {i} "
        i += 1
    return text


def test_cross_slot_1000_token_prefix_equals_cold(start_server, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prefix = long_prefix(tok)
    a, b = prefix + "Question one?", prefix + "Second question here?"
    ta, tb = tok.encode(a, add_special=True), tok.encode(b, add_special=True)
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert shared >= 1000
    warm = start_server("-np", "2", "-c", "8192", "--dtype", "float32")
    complete(warm, a, id_slot=0)
    r = complete(warm, b, id_slot=1, n_predict=12)
    assert cn(r) == (shared, len(tb) - shared)
    cold = start_server("-np", "1", "-c", "4096", "--dtype", "float32", "--cache-ram", "0")
    ref = complete(cold, b, n_predict=12)
    assert cn(ref) == (0, len(tb))
    assert r["content"] == ref["content"]
    # OpenAI face: cached_tokens and timings.cache_n agree
    body = {"model": "x", "prompt": b, "max_tokens": 1, "temperature": 0}
    o = post(warm, "/v1/completions", body)
    assert o["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tb) - 1


def test_cache_salt(start_server):
    srv = start_server("-np", "1")
    complete(srv, Q1, cache_salt="alice")
    r = complete(srv, Q1, cache_salt="bob")
    # nothing about alice's entry reaches bob: no cache_miss (issue #11)
    assert cn(r) == (0, 38) and "cache_miss" not in r["timings"]
    assert cn(complete(srv, Q1, cache_salt="alice")) == (37, 1)


def test_small_cache_ram_fill_and_evict_matches_no_cache(start_server):
    """--cache-ram 1 holds 2 of SmolLM2's 16-token blocks (368,640 bytes each): prompts that
    share prefixes fill and evict it; every output equals the --cache-ram 0 server's."""
    prompts = [PRE + f" Question {i}: int x = {i}/0;" for i in range(4)]
    prompts += [f"Note {i}. " + PRE for i in range(2)] + [Q1, Q2, Q1]
    small = start_server("-np", "1", "--cache-ram", "1", "--dtype", "float32")
    off = start_server("-np", "1", "--cache-ram", "0", "--dtype", "float32")
    hits = 0
    for p in prompts * 2:
        r1, r0 = complete(small, p, n_predict=6), complete(off, p, n_predict=6)
        hits += r1["timings"]["cache_n"] > 0
        assert r1["content"] == r0["content"], p
    assert hits > 0
