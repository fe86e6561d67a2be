"""The Responses API's in-memory store (kvserve/serving/response_store.py): bounded by count and
bytes, least recently used evicted first, oversized entries refused."""

from __future__ import annotations

import pytest

from kvserve.serving.response_store import ResponseStore, entry_bytes


def _resp(rid: str, text: str = "") -> dict:
    return {"id": rid, "object": "response", "output_text": text}


def _hist(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_put_get_delete():
    s = ResponseStore()
    assert s.put("a", _resp("a"), _hist())
    e = s.get("a")
    assert e.response == _resp("a") and e.history == ({"role": "user", "content": "hi"},)
    assert e.nbytes == entry_bytes(_resp("a"), _hist()) == len('{"id":"a","object":"response","output_text":""}'
                                                                 '[{"role":"user","content":"hi"}]' '[]')
    assert len(s) == 1 and s.nbytes == e.nbytes
    assert s.delete("a") is True
    assert s.get("a") is None and s.delete("a") is False
    assert len(s) == 0 and s.nbytes == 0


def test_count_bound_evicts_least_recently_used():
    s = ResponseStore(max_responses=3)
    for rid in "abc":
        s.put(rid, _resp(rid), _hist())
    assert s.get("a") is not None  # a is now the most recent: b goes first
    s.put("d", _resp("d"), _hist())
    assert [rid for rid in "abcd" if s.get(rid) is not None] == ["a", "c", "d"]
    assert len(s) == 3


def test_byte_bound_evicts_until_the_new_entry_fits():
    one = entry_bytes(_resp("a", "x" * 100), _hist())
    s = ResponseStore(max_bytes=3 * one)
    for rid in "abc":
        assert s.put(rid, _resp(rid, "x" * 100), _hist())
    assert s.nbytes == 3 * one
    big = _resp("d", "x" * (100 + one))  # about twice the size of one entry: two must go
    assert s.put("d", big, _hist())
    assert s.get("a") is None and s.get("b") is None and s.get("c") is not None and s.get("d") is not None
    assert s.nbytes == one + entry_bytes(big, _hist()) <= 3 * one


def test_an_entry_larger_than_the_budget_is_not_stored_and_evicts_nothing():
    s = ResponseStore(max_bytes=200)
    assert s.put("a", _resp("a"), _hist())
    assert s.put("b", _resp("b", "x" * 500), _hist()) is False
    assert s.get("b") is None and s.get("a") is not None and len(s) == 1


def test_replacing_an_id_counts_it_once():
    s = ResponseStore()
    s.put("a", _resp("a", "x" * 50), _hist())
    s.put("a", _resp("a", "y"), _hist())
    assert len(s) == 1 and s.nbytes == entry_bytes(_resp("a", "y"), _hist())
    assert s.get("a").response["output_text"] == "y"
    # an oversized replacement drops the old entry (a later read must not see stale data)
    small = ResponseStore(max_bytes=entry_bytes(_resp("a"), _hist()))
    small.put("a", _resp("a"), _hist())
    assert small.put("a", _resp("a", "z" * 10), _hist()) is False
    assert small.get("a") is None and small.nbytes == 0


def test_non_ascii_is_counted_as_the_escaped_text_held():
    assert entry_bytes({"t": "\u00e9"}, []) == len('{"t":"\\u00e9"}[][]')  # é is held as 6 ASCII bytes
    s = ResponseStore()
    s.put("a", {"t": "\u00e9\U0001F600"}, [])
    assert s.get("a").response_json == b'{"t":"\\u00e9\\ud83d\\ude00"}' and s.get("a").response == {"t": "\u00e9\U0001F600"}


def test_counted_bytes_are_the_memory_held():
    # each part is held as its compact JSON bytes: the count is their length, whatever the
    # objects would cost parsed (an {} is 2 bytes here, ~64 as a dict)
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    s = ResponseStore()
    s.put("a", _resp("a"), [{}] * 1000, items)
    e = s.get("a")
    parts = (e.response_json, e.history_json, e.input_items_json)
    assert all(isinstance(p, bytes) for p in parts)
    assert e.nbytes == s.nbytes == sum(len(p) for p in parts) == 47 + (2 * 1000 + 999 + 2) + len(
        '[{"id":"msg_1","type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}]')
    assert e.history == ({},) * 1000 and e.input_items == tuple(items)
    assert e.history is not s.get("a").history  # parsed anew on each read: a caller cannot change the entry


def test_entries_are_visible_to_their_owner_only():
    s = ResponseStore()
    s.put("a", _resp("a"), _hist(), owner="k1")
    assert s.get("a") is None and s.get("a", "k2") is None and s.get("a", "k1").response == _resp("a")
    assert s.delete("a", "k2") is False and s.delete("a") is False and len(s) == 1
    assert s.delete("a", "k1") is True and len(s) == 0 and s.nbytes == 0


@pytest.mark.parametrize("kw", [{"max_responses": 0}, {"max_bytes": 0}])
def test_limits_must_be_positive(kw):
    with pytest.raises(ValueError):
        ResponseStore(**kw)


def test_input_items_are_kept_and_counted():
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    s = ResponseStore()
    s.put("a", _resp("a"), _hist(), items)
    e = s.get("a")
    assert e.input_items == tuple(items)
    assert e.nbytes == entry_bytes(_resp("a"), _hist(), items) > entry_bytes(_resp("a"), _hist())
