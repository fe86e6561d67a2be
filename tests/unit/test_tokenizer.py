"""Tokenizer tests: SmolLM2 GGUF vs llama-server reference output, tiny vocab vs HF tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve.loaders.tokenizer import (
    VOCAB_TYPE_BPE,
    VOCAB_TYPE_SPM,
    Tokenizer,
    UnsupportedTokenizerError,
    read_gguf_metadata,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tinymodel as tm  # noqa: E402

REF = Path(__file__).parents[1] / "reference" / "smollm2"
ROWS = [json.loads(line) for line in (REF / "tokenize.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smol(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(smollm2_gguf)


@pytest.mark.parametrize("row", ROWS, ids=[repr(r["text"])[:40] for r in ROWS])
def test_smollm2_reference(smol: Tokenizer, row: dict) -> None:
    ids = smol.encode(row["text"], parse_special=True)
    assert ids == row["tokens_parse_special"]
    assert smol.encode(row["text"], parse_special=False) == row["tokens_no_special"]
    assert [{"id": i, "piece": smol.piece(i)} for i in ids] == row["pieces"]
    assert smol.decode(ids) == row["detokenized"]


def test_smollm2_specials(smol: Tokenizer) -> None:
    im_end = smol.encode("<|im_end|>")
    assert im_end == [2]
    assert smol.bos_token == "<|im_start|>" and smol.bos_token_id == 1
    assert smol.eos_token == "<|im_end|>" and smol.eos_token_id == 2
    assert smol.add_bos is False and smol.add_eos is False
    assert {0, 2} <= smol.eog_token_ids
    assert 4 in smol.eog_token_ids  # <reponame> is llama.cpp's FIM_REP token -> EOG
    assert 1 not in smol.eog_token_ids
    assert smol.n_vocab == 49152
    assert smol.vocab_type == VOCAB_TYPE_BPE and smol.pre == "smollm"
    assert smol.is_control(2) and not smol.is_control(905)
    assert smol.token_bytes(2) == b"<|im_end|>"
    assert smol.token_bytes(2, special=False) == b""
    assert smol.decode([19556, 2, 905], skip_special=True) == "Hello world"
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    # add_special adds nothing for SmolLM2 (add_bos false)
    assert smol.encode("Hello", add_special=True) == [19556]


def test_partial_utf8_pieces(smol: Tokenizer) -> None:
    ids = smol.encode("é🇷中")
    assert [smol.token_bytes(i) for i in ids] == [b"\xc3\xa9", b"\xf0\x9f", b"\x87", b"\xb7", b"\xe4\xb8\xad"]
    assert smol.piece(ids[1]) == [0xF0, 0x9F]
    assert smol.decode(ids[:2]) == "é\ufffd"


def test_metadata_reader_matches_gguf(smollm2_gguf) -> None:
    f = read_gguf_metadata(smollm2_gguf)
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "smollm"
    assert len(f["tokenizer.ggml.tokens"]) == 49152
    assert f["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
    assert f["tokenizer.ggml.merges"][0] == "Ġ t"
    assert f["tokenizer.ggml.add_bos_token"] is False
    assert f["tokenizer.ggml.bos_token_id"] == 1


# ---------------------------------------------------------------- tiny vocab

def _tiny_fields(**over) -> dict:
    tokens, types, merges = tm.tiny_vocab()
    f = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": tm.CHATML_TEMPLATE,
    }
    f.update(over)
    return f


TINY_TEXTS = [
    "the cat and the dog", "Hello, world! 12345", "  leading", "trailing  ", "a\n\nb\r\n",
    "héllo wörld 中文 😀", "<|im_start|>user\nhi<|im_end|>\n", "it's they're", "",
]


@pytest.mark.parametrize("text", TINY_TEXTS)
def test_tiny_gguf_matches_hf(text: str) -> None:
    ours = Tokenizer.from_gguf(_tiny_fields())
    ref = tm.hf_tokenizer()
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text


def test_tiny_gguf_basics() -> None:
    tok = Tokenizer.from_gguf(_tiny_fields())
    tokens, _, _ = tm.tiny_vocab()
    assert tok.n_vocab == len(tokens)
    assert tok.encode(" the") == [tokens.index("Ġthe")]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_end|>", parse_special=False) != [2]
    assert tok.eog_token_ids == frozenset({0, 2})
    assert tok.chat_template == tm.CHATML_TEMPLATE
    tok2 = Tokenizer.from_gguf(_tiny_fields(**{"tokenizer.ggml.add_bos_token": True,
                                               "tokenizer.ggml.bos_token_id": 1}))
    assert tok2.encode("x", add_special=True)[0] == 1


def test_tiny_hf_dir(tmp_path: Path) -> None:
    tm.hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": tm.CHATML_TEMPLATE,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    gg = Tokenizer.from_gguf(_tiny_fields())
    for text in TINY_TEXTS:
        assert tok.encode(text) == gg.encode(text)
        assert tok.encode(text, parse_special=False) == gg.encode(text, parse_special=False)
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and not tok.add_bos
    assert {0, 2} <= tok.eog_token_ids
    assert tok.chat_template == tm.CHATML_TEMPLATE
    assert tok.is_control(1) and tok.token_bytes(1, special=False) == b""


@pytest.mark.parametrize("pre,text,pieces", [
    ("smollm", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
    ("starcoder", "12345", ["1", "2", "3", "4", "5"]),
    ("gpt2", "x 12345", ["x", "Ġ12345"]),
    ("llama-bpe", "12345 it's", ["123", "45", "Ġit", "'s"]),
    ("qwen2", "12 ab", ["1", "2", "Ġab"]),
    ("default", "a+b 1234", ["a", "+", "b", "Ġ", "123", "4"]),
])
def test_pre_tokenizer_regexes(pre: str, text: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf(_tiny_fields(**{"tokenizer.ggml.pre": pre}))
    got = [p for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(text)]
    assert got == pieces


def test_unsupported() -> None:
    with pytest.raises(UnsupportedTokenizerError, match="'t5'"):
        Tokenizer.from_gguf(_tiny_fields(**{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(UnsupportedTokenizerError, match="pre-tokenizer"):
        Tokenizer.from_gguf(_tiny_fields(**{"tokenizer.ggml.pre": "no-such-pre"}))


def test_spm_vocab() -> None:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "a", "b", "▁a", "ab", "▁ab", "c"]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * (3 + 256) + [-1.0, -2.0, -2.0, -3.0, -5.0, -4.0, -2.0]
    tok = Tokenizer.from_gguf({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    })
    tid = {t: i for i, t in enumerate(tokens)}
    assert tok.vocab_type == VOCAB_TYPE_SPM
    assert tok.add_bos  # llama.cpp default for SPM
    assert tok.encode("ab", add_special=True) == [1, tid["▁ab"]]
    assert tok.encode("é") == [tid["▁"], tid["<0xC3>"], tid["<0xA9>"]]
    assert tok.decode(tok.encode("ab c")) == " ab c"
    assert tok.encode("</s>a") == [2, tid["▁a"]]  # space prefix after a special token
    assert tok.token_bytes(tid["<0xC3>"]) == b"\xc3"
    assert 2 in tok.eog_token_ids


def test_lone_surrogates_become_replacement_characters(smollm2_gguf):
    """JSON "\\ud800" or undecodable stdin (surrogateescape) must not crash the tokenizer."""
    from kvserve.loaders.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_file(smollm2_gguf)
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    assert tok.encode_batch(["\udcff x"]) == [tok.encode("\ufffd x")]


def test_long_text_batch_path_gives_the_same_ids(smol: Tokenizer) -> None:
    """Texts above 64 Ki characters go through the HF batch encoder (it releases the GIL for the
    whole call; the single encoder holds it while converting offsets): the ids must not change."""
    from kvserve.loaders import tokenizer as tk

    unit = "def f(x):\n    return x + 1  # wörld 🙂 <|im_start|>user\n\n"
    text = unit * (tk._LONG_TEXT // len(unit) + 3)
    assert len(text) > tk._LONG_TEXT
    direct = smol._hf.encode(text, add_special_tokens=False).ids
    assert smol.encode(text) == direct
    assert smol.encode(text + "\ud800") == smol._hf.encode(text + "\ufffd", add_special_tokens=False).ids
    assert len(direct) == 25805


# ---------------------------------------------------------------- start-up shortcuts

def test_byte_level_decode_table_matches_the_char_map() -> None:
    """The str.translate path gives the per-character map's bytes for every character below
    U+0180 (byte-level characters, raw control and Latin-1 characters: UTF-8) and falls back
    for characters above U+00FF outside the map."""
    from kvserve.loaders.tokenizer import _BYTE_TO_CHAR, _CHAR_TO_BYTE, _byte_level_decode

    def slow(text: str) -> bytes:
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text)

    assert _byte_level_decode("".join(_BYTE_TO_CHAR[b] for b in range(256))) == bytes(range(256))
    for o in range(0x180):
        c = chr(o)
        assert _byte_level_decode("a" + c + "Ġ") == slow("a" + c + "Ġ"), o
    assert _byte_level_decode("\xad") == b"\xc2\xad"  # a raw soft hyphen (not in the map): its UTF-8
    assert _byte_level_decode("中Ġ") == "中".encode() + b" "  # the fallback
    assert _byte_level_decode("ĠhelloĊ") == b" hello\n"


def test_plain_twin_shares_the_model_and_matches_a_reparse(smol: Tokenizer) -> None:
    """The parse_special=False tokenizer is built on the same model object (no second parse of
    the vocabulary) and is the same tokenizer as one parsed from the JSON."""
    from tokenizers import Tokenizer as HF

    plain, hf = smol._hf_plain, smol._hf
    assert plain.to_str() == hf.to_str()
    assert plain.encode_special_tokens is True and hf.encode_special_tokens is False
    ref = HF.from_str(hf.to_str())
    ref.encode_special_tokens = True
    for text in ["<|im_start|>user\nhi<|im_end|>", "<|endoftext|> x <reponame>", "plain text  \n\t", "é🇷中"]:
        assert plain.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False).ids
    assert smol.encode("<|im_end|>", parse_special=False) == [44, 108, 306, 79, 486, 108, 46]
    assert smol.encode("<|im_end|>") == [2]


def test_plain_twin_of_an_hf_dir(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HF

    tm.hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok._hf_plain.to_str() == tok._hf.to_str()
    ref = HF.from_str(tok._hf.to_str())
    ref.encode_special_tokens = True
    plain = tok.encode("<|im_end|>x", parse_special=False)
    assert plain == ref.encode("<|im_end|>x", add_special_tokens=False).ids and len(plain) > 2
    assert tok.encode("<|im_end|>x")[0] == 2
