"""Issue #11, part B, through a real server (SmolLM2): a lone-surrogate cache_salt leaves the engine
alive, no response or /slots view shows another user's text, an erase empties the host tier too,
slot ids are ASCII digits, and slot files in the folder must be regular files (a FIFO froze the
engine)."""

from __future__ import annotations

import os
import re

import httpx
import pytest

SECRET = "my secret password is hunter2, please remember it for later."
PROBE = "my secret password is something else entirely, is it not?"
TIMEOUT = 60


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slotfiles")


@pytest.fixture(scope="module")
def srv(start_server_module, slot_dir):
    """Defaults (auto --cache-ram, /slots without text) with two slots and slot files."""
    return start_server_module("-np", "2", "--slot-save-path", str(slot_dir))


def post(srv, path, body=None, *, raw: str | None = None, status: int = 200, timeout: float = TIMEOUT):
    if raw is not None:
        r = httpx.post(srv.url(path), content=raw.encode(), headers={"Content-Type": "application/json"},
                       timeout=timeout)
    else:
        r = httpx.post(srv.url(path), json=body, timeout=timeout)
    assert r.status_code == status, r.text
    return r


def complete(srv, prompt, **kw):
    # ignore_eos: exactly 2 tokens whatever the model picks (these tests ask whether the engine still
    # generates; under the AVX512 group kernel's rounding SmolLM2 ends "Still generating?" after one)
    return post(srv, "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0, "ignore_eos": True, **kw})


def test_lone_surrogate_cache_salt_leaves_the_engine_alive(srv):
    """The issue's repro: every later request got 500 EngineDeadError, slot actions hung, /health said ok."""
    r = httpx.post(srv.url("/completion"), content=b'{"prompt": "Hi", "n_predict": 2, "cache_salt": "\\ud800"}',
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    # the face refuses it (the engine would cope too: tests/unit/test_hardening_engine.py)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Field 'cache_salt': string is not valid Unicode (lone surrogate U+D800)"
    assert complete(srv, "Hello there").json()["tokens_predicted"] == 2
    h = httpx.get(srv.url("/health"), timeout=10)
    assert (h.status_code, h.json()) == (200, {"status": "ok"})
    assert post(srv, "/slots/1?action=erase", {}, timeout=10).json()["id_slot"] == 1


def test_no_response_shows_another_users_prompt(srv):
    """The issue's repro: "my secret password is hunter2" came back to a second client in cached_excerpt."""
    complete(srv, SECRET, cache_salt="alice", id_slot=0)
    r = complete(srv, PROBE, cache_salt="bob", id_slot=0)
    assert "hunter2" not in r.text and "cache_miss" not in r.json()["timings"]
    # unsalted requests on another slot: counts and positions only
    complete(srv, SECRET, id_slot=0)
    r = complete(srv, PROBE, id_slot=1)
    m = r.json()["timings"]["cache_miss"]
    assert "hunter2" not in r.text and "cached_excerpt" not in m
    assert (m["reason"], m["n_reused"]) == ("prefix differs", m["first_diff_pos"])


def test_slots_view_hides_request_text_unless_slots_is_given(srv, start_server):
    body = {"prompt": "Say something.", "n_predict": 2, "stop": ["hunter2"], "id_slot": 0,
            "dry_sequence_breakers": ["swordfish"], "grammar": 'root ::= "hunter2" | [a-z]+'}
    post(srv, "/completion", body)
    r = httpx.get(srv.url("/slots"), timeout=10)
    p = r.json()[0]["params"]  # llama-server's metrics view: the text fields are left out
    assert not {"stop", "grammar", "dry_sequence_breakers"} & set(p) and p["n_predict"] == 2
    assert "hunter2" not in r.text and "swordfish" not in r.text
    explicit = start_server("-np", "1", "--slots")
    post(explicit, "/completion", body)
    p = httpx.get(explicit.url("/slots"), timeout=10).json()[0]["params"]
    assert (p["stop"], p["dry_sequence_breakers"]) == (["hunter2"], ["swordfish"]) and "hunter2" in p["grammar"]


def test_erase_empties_the_host_tier_and_the_default_tier_is_logged(srv):
    """The issue's repro: with the host tier on, the request after an erase reused 37 tokens."""
    q = "You are a careful Java reviewer. Erase test prompt: list each bug with its line number."
    first = complete(srv, q, id_slot=0).json()
    assert first["timings"]["cache_n"] == 0
    assert post(srv, "/slots/0?action=erase", {}).json() == {"id_slot": 0,
                                                               "n_erased": first["tokens_evaluated"] + 1}
    assert complete(srv, q, id_slot=0).json()["timings"]["cache_n"] == 0
    assert complete(srv, q, id_slot=0).json()["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    m = re.search(r"host KV tier \(--cache-ram\): (\d+) MiB \(flag not given: min\(8192 MiB, MemAvailable / 4\)\)",
                  srv.log())
    assert m and 0 < int(m.group(1)) <= 8192


@pytest.mark.parametrize("sid", ["\u0661", "+1", " 1", "1_0", "0x1", "-1", "2", "9" * 5000])
def test_slot_ids_are_ascii_digits(srv, sid):
    r = post(srv, f"/slots/{sid}?action=erase", {}, status=400)
    assert r.json()["error"]["message"] == "Invalid slot ID"


@pytest.mark.parametrize("action", ["save", "restore"])
def test_slot_filename_with_a_lone_surrogate_is_400(srv, action):
    r = post(srv, f"/slots/0?action={action}", raw='{"filename": "a\\ud800.bin"}', status=400)
    assert r.json()["error"]["message"] == "Field 'filename': string is not valid Unicode (lone surrogate U+D800)"


def test_fifo_and_symlink_in_the_slot_folder_are_refused_without_stalling(srv, slot_dir):
    """The issue's repro: restoring from a FIFO in the slot folder froze all generation."""
    os.mkfifo(slot_dir / "fifo.bin")
    (slot_dir / "link.bin").symlink_to("/etc/passwd")
    r = post(srv, "/slots/0?action=restore", {"filename": "fifo.bin"}, status=400, timeout=10)
    assert r.json()["error"]["message"] == "slot file is a FIFO, not a regular file: refused"
    r = post(srv, "/slots/0?action=save", {"filename": "fifo.bin"}, status=400, timeout=10)
    assert r.json()["error"]["message"] == "slot file exists and is a FIFO, not a regular file: refused"
    r = post(srv, "/slots/0?action=restore", {"filename": "link.bin"}, status=400, timeout=10)
    assert r.json()["error"]["message"] == "slot file is a symbolic link: refused (links are not followed)"
    r = post(srv, "/slots/0?action=save", {"filename": "link.bin"}, status=400, timeout=10)
    assert r.json()["error"]["message"] == "slot file exists and is a symbolic link, not a regular file: refused"
    assert (slot_dir / "link.bin").is_symlink()
    assert complete(srv, "Still generating?").json()["tokens_predicted"] == 2
    # a regular file still round-trips
    complete(srv, "Save me, please.", id_slot=1, n_predict=0)
    s = post(srv, "/slots/1?action=save", {"filename": "ok.bin"}).json()
    r = post(srv, "/slots/1?action=restore", {"filename": "ok.bin"}).json()
    assert (r["n_restored"], r["n_read"]) == (s["n_saved"], s["n_written"])


def test_cache_miss_text_only_for_the_same_key_or_salt(srv, start_server):
    """Issue 31: an unsalted caller landing on a slot saw the text the previous request left there. No key
    and no salt: counts only; with --api-key, a caller sees the cached text of its own key's requests."""
    secret, probe = "The vault code is hunter2, written down in the blue notebook.", \
        "The vault code is unknown to me, so please tell me."
    complete(srv, secret, id_slot=0)
    m = complete(srv, probe, id_slot=0).json()["timings"]["cache_miss"]
    assert m["reason"] == "prefix differs" and "cached_excerpt" not in m and "hunter2" not in str(m)
    keyed = start_server("-np", "1", "--api-key", "key-one,key-two")

    def ask(prompt, key):
        r = httpx.post(keyed.url("/completion"), json={"prompt": prompt, "n_predict": 2, "temperature": 0,
                                                        "ignore_eos": True, "id_slot": 0},
                       headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["timings"].get("cache_miss")

    ask(secret, "key-one")
    m = ask(probe, "key-two")
    assert m["reason"] == "prefix differs" and "cached_excerpt" not in m
    ask(secret, "key-one")
    m = ask(probe.replace("unknown", "not known"), "key-one")
    assert "hunter2" in m["cached_excerpt"]
