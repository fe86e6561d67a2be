"""Issue #11, part B, on the tiny model: the engine survives a failing request, dies loudly only when
it really is broken, diagnostics never show another salt's or slot's text, the host tier is sized to
the machine and erased with its slot, and slot files refuse links, FIFOs and other non-files."""

import asyncio
import concurrent.futures
import logging
import os
import threading

import pytest
import torch

from kvserve.config import DEFAULT_CACHE_RAM_MIB, EngineConfig, auto_cache_ram_mib, mem_available_bytes
from kvserve.engine.async_engine import MAX_CONSECUTIVE_FAILED_STEPS, AsyncEngine, EngineDeadError
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import root_key
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.slot_file import SlotFileError, read_slot_file
from kvserve.models.build import load_files


def core_for(path, **kw) -> EngineCore:
    kw.setdefault("n_ctx", 512)
    kw.setdefault("n_parallel", 2)
    kw.setdefault("dtype", "float32")
    kw.setdefault("cache_ram", 0)
    return EngineCore(load_files(path), EngineConfig(**kw))


def req(rid, ids, n=4, slot=-1, salt=None, owner=None):
    return Request(rid, list(ids), SamplingParams(temperature=0, n_predict=n, ignore_eos=True),
                   priority_slot=slot, cache_salt=salt, owner=owner)


def drive(core, reqs, max_steps=500):
    """Add ``reqs`` and step until each has its final output: {request_id: [outputs]}."""
    outs = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    for _ in range(max_steps):
        if all(o and o[-1].finished for o in outs.values()):
            return outs
        for o in core.step():
            outs[o.request_id].append(o)
    raise AssertionError("requests did not finish")


def toks(outs):
    return [t for o in outs for t in o.new_token_ids]


A = list(range(20, 40))
B = list(range(50, 70))
C = list(range(80, 100))


def all_free(core) -> bool:
    return core.kv.num_free_blocks == core.kv.num_blocks - 1 and not core.has_work()


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    outs = drive(core_for(tiny_gguf), [req("a", A), req("b", B), req("c", C)])
    return {k: toks(v) for k, v in outs.items()}


# -- one request's failure fails that request only ---------------------------------------------

def test_failure_while_admitting_one_request(tiny_gguf, reference, monkeypatch):
    core = core_for(tiny_gguf)
    admit = core.scheduler._admit

    def broken(r, budget):
        if r.request_id == "b":
            raise RuntimeError("injected")
        return admit(r, budget)

    monkeypatch.setattr(core.scheduler, "_admit", broken)
    outs = drive(core, [req("a", A), req("b", B), req("c", C)])
    bad = outs["b"][-1]
    assert (bad.finished, bad.stop_type, bad.new_token_ids) == (True, "abort", [])
    assert bad.error == "the engine failed on this request (RuntimeError); other requests are not affected"
    assert (toks(outs["a"]), toks(outs["c"])) == (reference["a"], reference["c"])
    assert all(o.error is None for o in outs["a"] + outs["c"])
    assert all_free(core) and core.consecutive_failed_steps == 0


def test_failure_while_updating_one_request_mid_generation(tiny_gguf, reference, monkeypatch):
    core = core_for(tiny_gguf, cache_ram=8192)
    accept = core._accept

    def broken(r, state, sample, now):
        if r.request_id == "b" and len(r.output_token_ids) == 2:
            raise ValueError("injected")
        return accept(r, state, sample, now)

    monkeypatch.setattr(core, "_accept", broken)
    outs = drive(core, [req("a", A, n=6), req("b", B, n=6), req("c", C, n=6)])
    assert toks(outs["b"]) == reference["b"][:2] and outs["b"][-1].error.startswith("the engine failed")
    assert toks(outs["a"])[:4] == reference["a"] and toks(outs["c"])[:4] == reference["c"]
    # the failed request's blocks are gone, not kept for reuse: its prompt is computed again
    assert core.kv.match_prefix(B, None, len(B) - 1).blocks == []
    monkeypatch.setattr(core, "_accept", accept)
    again = drive(core, [req("b2", B, n=4)])["b2"]
    assert toks(again) == reference["b"] and again[-1].timings.cache_n == 0


def test_failure_while_adding_one_request(tiny_gguf, reference, monkeypatch):
    from kvserve.engine import core as core_mod

    eng = AsyncEngine(core_for(tiny_gguf))
    real = core_mod.SequenceSampler

    def sampler(params, *a):
        if params.n_predict == 3:
            raise KeyError("injected")
        return real(params, *a)

    monkeypatch.setattr(core_mod, "SequenceSampler", sampler)

    async def collect(r):
        return [o async for o in eng.generate(r)]

    async def main():
        return await asyncio.gather(collect(req("a", A)), collect(req("b", B, n=3)), collect(req("c", C)))

    try:
        a, b, c = asyncio.run(main())
        assert [o.error for o in b] == ["the engine failed on this request (KeyError); other requests are not "
                                        "affected"]
        assert (toks(a), toks(c)) == (reference["a"], reference["c"])
        assert eng.alive and eng.call(all_free).result(timeout=10)
    finally:
        eng.shutdown()


def test_lone_surrogate_cache_salt_does_not_kill_the_engine(tiny_gguf, reference):
    """The issue's repro: hashing the salt "\\ud800" as UTF-8 raised on the engine thread."""
    assert root_key("\ud800") != root_key("\udfff") != root_key(None)
    eng = AsyncEngine(core_for(tiny_gguf))

    async def collect(r):
        return [o async for o in eng.generate(r)]

    try:
        first = asyncio.run(collect(req("s1", A, slot=0, salt="\ud800")))
        assert toks(first) == reference["a"] and first[-1].error is None
        again = asyncio.run(collect(req("s2", A, slot=0, salt="\ud800")))
        assert again[-1].timings.cache_n == len(A) - 1  # the salt keys the cache as any other
        other = asyncio.run(collect(req("s3", B)))
        assert toks(other) == reference["b"] and eng.alive
        assert eng.call(lambda core: core.erase_slot(0)).result(timeout=10) == {"n_erased": len(A) + 3}
    finally:
        eng.shutdown()


# -- a step that fails as a whole ------------------------------------------------------------------

def test_failed_forward_fails_its_step_and_the_engine_serves_on(tiny_gguf, reference, monkeypatch):
    core = core_for(tiny_gguf)
    execute = core.runner.execute
    calls = []

    def once(*a):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return execute(*a)

    monkeypatch.setattr(core.runner, "execute", once)
    outs = drive(core, [req("a", A), req("b", B)])
    assert [o[-1].error is not None for o in outs.values()] == [True, True]
    assert core.consecutive_failed_steps == 1 and all_free(core)
    outs = drive(core, [req("c", C)])
    assert toks(outs["c"]) == reference["c"] and core.consecutive_failed_steps == 0


def test_repeated_step_failures_kill_the_engine_loudly(tiny_gguf, monkeypatch):
    eng = AsyncEngine(core_for(tiny_gguf))

    def broken(*a):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.core.runner, "execute", broken)

    async def one(i):
        try:
            return [o async for o in eng.generate(req(f"r{i}", A))][-1].error
        except EngineDeadError as e:
            return f"dead: {e}"

    async def main():
        return [await one(i) for i in range(MAX_CONSECUTIVE_FAILED_STEPS + 1)]

    try:
        errors = asyncio.run(main())
        assert errors[:-1] == ["the engine failed on this request (RuntimeError); other requests are not "
                               "affected"] * MAX_CONSECUTIVE_FAILED_STEPS
        assert errors[-1] == f"dead: engine failed: {MAX_CONSECUTIVE_FAILED_STEPS} engine steps in a row failed"
        assert not eng.alive
        with pytest.raises(EngineDeadError):  # at once: a call never hangs on a dead engine
            eng.call(lambda core: 1).result(timeout=1)
        # the server then answers 500 on every route of that model, /health included
        from kvserve.faces.api_error import ApiError
        from kvserve.serving.args import parse_args
        from kvserve.serving.manager import ModelSpec
        from kvserve.serving.chat_runner import Runner

        runner = Runner(parse_args(["m.gguf"]), ModelSpec("m", "m.gguf", pinned=True), eng, None, "b1-test")
        with pytest.raises(Exception) as e:
            runner.require_ready()
        err = ApiError.from_exception(e.value)
        assert (err.status, err.message) == (
            500, "the engine failed (EngineDeadError) and serves no more requests: restart the server")
    finally:
        eng.shutdown()


def test_call_after_shutdown_fails_at_once(tiny_gguf):
    eng = AsyncEngine(core_for(tiny_gguf))
    assert eng.call(lambda core: core.n_slots).result(timeout=10) == 2
    eng.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        eng.call(lambda core: 1).result(timeout=1)


# -- cache_miss shows no other user's text -----------------------------------------------------------

def test_cache_miss_never_shows_another_salts_or_slots_text(tiny_gguf):
    core = core_for(tiny_gguf)
    enc = lambda s: core.tokenizer.encode(s, add_special=False)  # noqa: E731
    secret = enc("my secret password is hunter2 and more")
    probe = enc("my secret password is guess and more")
    n_common = next(i for i, (x, y) in enumerate(zip(secret, probe)) if x != y)
    drive(core, [req("alice", secret, slot=0, salt="alice")])
    # another salt: nothing at all, not even how far the prompts agree
    bob = drive(core, [req("bob", probe, slot=0, salt="bob")])["bob"][-1].timings
    assert (bob.cache_n, bob.cache_miss) == (0, None)
    # unsalted requests share a namespace: counts and positions, but no text of slot 0's history
    drive(core, [req("u1", secret, slot=0)])
    m = drive(core, [req("u2", probe, slot=1)])["u2"][-1].timings.cache_miss
    assert (m["reason"], m["n_reused"], m["first_diff_pos"]) == ("prefix differs", n_common, n_common)
    assert "cached_excerpt" not in m and "hunter" not in str(m)
    assert list(m) == ["n_reused", "best_candidate_tokens", "first_diff_pos", "prompt_excerpt", "reason"]
    # the request's own slot history under its own salt: the excerpt is shown
    drive(core, [req("me1", secret, slot=0, salt="me")])
    mine = drive(core, [req("me2", probe, slot=0, salt="me")])["me2"][-1].timings.cache_miss
    assert "hunter2" in mine["cached_excerpt"] and "guess" in mine["prompt_excerpt"]


def test_cache_miss_shows_the_slots_text_only_to_its_owner(tiny_gguf):
    """Issue 31's repro: an unsalted caller landing on a slot saw the text the previous (unsalted) request
    left there. Now: no key and no salt, counts and the reason only; the same API key (owner), the text."""
    core = core_for(tiny_gguf)
    enc = lambda s: core.tokenizer.encode(s, add_special=False)  # noqa: E731
    keys = ["n_reused", "best_candidate_tokens", "first_diff_pos", "prompt_excerpt", "reason"]

    def pair(word: str, owner_a: str | None, owner_b: str | None, salt: str | None = None) -> dict:
        secret = enc(f"the {word} password is hunter2 and more")
        probe = enc(f"the {word} password is guess and more")
        n_common = next(i for i, (x, y) in enumerate(zip(secret, probe)) if x != y)
        drive(core, [req(f"{word}-a", secret, slot=0, owner=owner_a, salt=salt)])
        m = drive(core, [req(f"{word}-b", probe, slot=0, owner=owner_b, salt=salt)])[f"{word}-b"][-1].timings.cache_miss
        assert (m["reason"], m["n_reused"], m["first_diff_pos"]) == ("prefix differs", n_common, n_common)
        return m

    m = pair("first", None, None)  # no key, no salt: the repro
    assert list(m) == keys and "hunter" not in str(m)
    m = pair("second", "key-a", "key-b")  # another key's text
    assert list(m) == keys and "hunter" not in str(m)
    m = pair("third", "key-a", "key-a")  # the caller's own earlier request
    assert "hunter2" in m["cached_excerpt"] and "guess" in m["prompt_excerpt"]
    # review 4: one salt under two keys shares KV (n_reused, as vLLM) but no text
    m = pair("fourth", "key-a", "key-b", salt="shared")
    assert list(m) == keys and "hunter" not in str(m)
    m = pair("fifth", None, "key-b", salt="shared")  # a keyless request's text is no key's either
    assert list(m) == keys and "hunter" not in str(m)
    m = pair("sixth", "key-a", "key-a", salt="shared")
    assert "hunter2" in m["cached_excerpt"]
    m = pair("seventh", None, None, salt="shared")  # no keys: the salt is the caller's secret
    assert "hunter2" in m["cached_excerpt"]


# -- host tier: sized to the machine, erased with its slot -----------------------------------------

def test_auto_cache_ram_is_a_quarter_of_mem_available_capped(tmp_path):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       16000000 kB\nMemAvailable:    4194304 kB\n")
    assert mem_available_bytes(str(mi)) == 4 << 30
    assert auto_cache_ram_mib(str(mi)) == 1024
    mi.write_text("MemAvailable:   67108864 kB\n")
    assert auto_cache_ram_mib(str(mi)) == DEFAULT_CACHE_RAM_MIB == 8192
    # no /proc/meminfo: a quarter of the physical memory, capped the same way
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert auto_cache_ram_mib(str(tmp_path / "none")) == min(8192, (phys // 4) >> 20)
    assert EngineConfig().cache_ram is None
    assert EngineConfig(cache_ram=100).cache_ram_mib() == 100 and EngineConfig(cache_ram=0).cache_ram_mib() == 0


def test_default_host_tier_size_is_logged(tiny_gguf, caplog, monkeypatch):
    import kvserve.config

    monkeypatch.setattr(kvserve.config, "mem_available_bytes", lambda meminfo="": 1 << 30)  # 1 GiB spare
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        core = EngineCore(load_files(tiny_gguf), EngineConfig(n_ctx=256, dtype="float32"))
    lines = [r.getMessage() for r in caplog.records if "host KV tier" in r.getMessage()]
    assert (core.cache_ram_mib, core.block_bytes, core.kv.host_blocks) == (256, 4096, 65536)  # capped blocks
    assert lines == ["host KV tier (--cache-ram): 256 MiB (flag not given: min(8192 MiB, MemAvailable / 4)), "
                     "65536 blocks of 4 KiB"]


def test_erase_drops_the_slots_blocks_from_the_host_tier(tiny_gguf):
    """The issue's repro: with the host tier on, a request after an erase reused 37 tokens."""
    core = core_for(tiny_gguf, cache_ram=8192, n_parallel=1)
    q = list(range(20, 58))  # 38 tokens
    assert drive(core, [req("a", q, slot=0)])["a"][-1].timings.cache_n == 0
    assert core.erase_slot(0) == {"n_erased": 38 + 3}
    assert core.kv.num_cached_blocks == 0 and all_free(core)
    assert drive(core, [req("b", q, slot=0)])["b"][-1].timings.cache_n == 0
    # without an erase the same request reuses all but its last token
    assert drive(core, [req("c", q, slot=0)])["c"][-1].timings.cache_n == 37


# -- slot files: only regular files, never blocking --------------------------------------------------

@pytest.fixture
def saved_slot(tiny_gguf, tmp_path):
    core = core_for(tiny_gguf)
    drive(core, [req("p", A, n=1, slot=0)])
    path = tmp_path / "good.bin"
    core.save_slot(0, str(path))
    return core, path


def test_restore_refuses_symlinks_fifos_and_directories(saved_slot, tmp_path):
    core, good = saved_slot
    spec = core.slot_file_spec()
    (tmp_path / "link.bin").symlink_to(good)
    os.mkfifo(tmp_path / "fifo.bin")
    (tmp_path / "dir.bin").mkdir()
    cases = {"link.bin": "slot file is a symbolic link: refused (links are not followed)",
             "fifo.bin": "slot file is a FIFO, not a regular file: refused",
             "dir.bin": "slot file is a directory, not a regular file: refused"}
    for name, msg in cases.items():
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # a FIFO must not block the open
            fut = ex.submit(read_slot_file, str(tmp_path / name), **spec)
            with pytest.raises(SlotFileError) as e:
                fut.result(timeout=5)
        assert str(e.value) == msg, name
    assert read_slot_file(str(good), **spec)[1] == A == core.slot_tokens(0)


def test_save_refuses_to_replace_a_link_or_fifo(saved_slot, tmp_path):
    core, good = saved_slot
    before = good.read_bytes()
    (tmp_path / "link.bin").symlink_to(good)
    os.mkfifo(tmp_path / "fifo.bin")
    with pytest.raises(SlotFileError, match="^slot file exists and is a symbolic link, not a regular file"):
        core.save_slot(0, str(tmp_path / "link.bin"))
    with pytest.raises(SlotFileError, match="^slot file exists and is a FIFO, not a regular file"):
        core.save_slot(0, str(tmp_path / "fifo.bin"))
    assert good.read_bytes() == before and (tmp_path / "link.bin").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.bin", "good.bin", "link.bin"]  # no temp left


def test_snapshot_and_load_split_the_io_from_the_engine(saved_slot, tmp_path):
    """The server runs snapshot_slot/load_slot on the engine thread and the file I/O in a worker."""
    from kvserve.engine.slot_file import write_slot_file

    core, _ = saved_slot
    hdr, tokens, layers = core.snapshot_slot(0)
    path = str(tmp_path / "split.bin")
    done = []
    t = threading.Thread(target=lambda: done.append(write_slot_file(path, hdr, tokens, layers)))
    t.start()
    t.join(10)
    _, t2, l2, n = read_slot_file(path, **core.slot_file_spec())
    assert (t2, n) == (tokens, done[0])
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(layers, l2) for a, b in ((ka, kb), (va, vb)))
    assert core.load_slot(1, t2, l2) == {"n_restored": len(tokens), "tokens": tokens}
    assert core.slot_tokens(1) == tokens


# -- review finding: a sampler that raises for one row fails that request only -------------------

def test_a_row_whose_sampler_raises_fails_only_its_request(tiny_gguf, reference, monkeypatch):
    """Before: a SamplingError inside the batch's sampling failed the whole step (a bystander's
    request died with it) and counted toward engine death."""
    from kvserve.engine import sampler as smp

    core = core_for(tiny_gguf)
    real = smp.SequenceSampler._sample

    def broken(self, logits, history, *a, **kw):
        if len(history) and history[0] == B[0]:
            raise smp.SamplingError("no token is allowed by the grammar mask")
        return real(self, logits, history, *a, **kw)

    monkeypatch.setattr(smp.SequenceSampler, "_sample", broken)
    mk = lambda rid, ids: Request(rid, list(ids), SamplingParams(temperature=0.5, top_k=0, seed=1, n_predict=4,
                                                              ignore_eos=True))  # noqa: E731 - the per-row chain
    outs = drive(core, [mk("a", A), mk("b", B), mk("c", C)])
    assert outs["b"][-1].error == ("the engine failed on this request (SamplingError); "
                                   "other requests are not affected")
    assert len(toks(outs["a"])) == 4 and len(toks(outs["c"])) == 4
    assert all(o.error is None for o in outs["a"] + outs["c"])
    assert core.consecutive_failed_steps == 0 and all_free(core)


def test_logit_bias_that_bans_every_token_is_refused_at_add(tiny_gguf):
    """Before: five such requests in a row killed the engine (each failed its whole step)."""
    from kvserve.engine.request import InvalidRequestError

    core = core_for(tiny_gguf)
    nv = core.model_config.n_vocab
    for ban in (float("-inf"), -1e39):  # -1e39 is -inf in float32
        params = SamplingParams(temperature=0, n_predict=2, logit_bias={t: ban for t in range(nv)})
        with pytest.raises(InvalidRequestError, match="every token of the vocabulary is banned"):
            core.add_request(Request(f"ban{ban}", A, params))
    params = SamplingParams(temperature=0, n_predict=2, logit_bias={t: -1e30 for t in range(nv)})
    assert len(toks(drive(core, [Request("ok", A, params)])["ok"])) == 2  # finite: still samples
    assert all_free(core)
