"""IncrementalDetokenizer: UTF-8 safety and stop strings, on real SmolLM2 tokens."""

from __future__ import annotations

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.loaders.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(smollm2_gguf)


def run(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[tuple[str, str | None]], str, IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop)
    events = [d.add(i) for i in ids]
    return events, d.flush(), d


def test_split_characters_emitted_whole(tok: Tokenizer) -> None:
    ids = tok.encode("é🇷中")
    assert ids == [2756, 10813, 225, 132, 28589]  # é | F0 9F | 87 | B7 | 中
    events, rest, d = run(tok, ids)
    assert events == [("é", None), ("", None), ("", None), ("🇷", None), ("中", None)]
    assert rest == ""
    assert d.text == "é🇷中"
    assert all("\ufffd" not in e for e, _ in events)


def test_emoji_three_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀 ok")
    events, rest, d = run(tok, ids)
    assert [e for e, _ in events][:3] == ["", "", "😀"]
    assert d.text == "😀 ok" and rest == ""


def test_flush_mid_character_drops_incomplete_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("ok😀")
    assert len(ids) >= 3
    events, rest, d = run(tok, ids[:-1])  # last byte of the emoji never arrives
    assert [e for e, _ in events] == ["ok"] + [""] * (len(ids) - 2)
    assert rest == ""
    assert d.text == "ok"


def test_stop_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello STOP here")
    assert [tok.token_bytes(i) for i in ids] == [b"Hello", b" ST", b"OP", b" here"]
    d = IncrementalDetokenizer(tok, ("STOP",))
    assert d.add(ids[0]) == ("Hello", None)
    assert d.add(ids[1]) == (" ", None)  # "ST" held back
    assert d.pending_text == "ST"
    assert d.add(ids[2]) == ("", "STOP")
    assert d.add(ids[3]) == ("", None)  # finished: ignored
    assert d.flush() == ""
    assert d.text == "Hello " and d.stop_string == "STOP" and d.finished


def test_stop_at_first_token(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    events, rest, d = run(tok, ids, ("Hello",))
    assert events == [("", "Hello"), ("", None)]
    assert rest == "" and d.text == ""


def test_no_partial_stop_leak(tok: Tokenizer) -> None:
    ids = tok.encode("Hello STOP here")
    events, rest, d = run(tok, ids, ("STOPPED",))
    assert events == [("Hello", None), (" ", None), ("", None), ("STOP here", None)]
    assert rest == "" and d.text == "Hello STOP here"
    # generation ends while a stop prefix is held: flush returns it
    events, rest, d = run(tok, ids[:3], ("STOPPED",))
    assert [e for e, _ in events] == ["Hello", " ", ""]
    assert rest == "STOP" and d.text == "Hello STOP"


def test_stop_inside_token_and_earliest_wins(tok: Tokenizer) -> None:
    ids = tok.encode(" the end")
    assert [tok.token_bytes(i) for i in ids] == [b" the", b" end"]
    d = IncrementalDetokenizer(tok, ("end", "he"))
    assert d.add(ids[0]) == (" t", "he")
    d = IncrementalDetokenizer(tok, ("e e", "d"))
    assert d.add(ids[0]) == (" th", None)  # "e" could start "e e"
    assert d.add(ids[1]) == ("", "e e")  # "e e" starts before "d"
    assert d.text == " th"


def test_stop_multibyte(tok: Tokenizer) -> None:
    events, rest, d = run(tok, tok.encode("é🇷中"), ("🇷",))
    assert [e for e, _ in events] == ["é", "", "", "", ""]
    assert events[3] == ("", "🇷") and d.text == "é"


def test_control_tokens_give_no_text(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, ("<|im_end|>",))
    assert d.add(tok.encode("Hi")[0]) == ("Hi", None)
    assert d.add(2) == ("", None)  # <|im_end|> is a control token: no text, no stop match
    assert d.flush() == "" and d.text == "Hi"
    d = IncrementalDetokenizer(tok, include_control=True)
    assert d.add(2) == ("<|im_end|>", None)


def test_no_stops_passthrough(tok: Tokenizer) -> None:
    text = "def f(x):\n    return x ** 2  # square\n"
    events, rest, d = run(tok, tok.encode(text))
    assert "".join(e for e, _ in events) == text and rest == "" and d.text == text
