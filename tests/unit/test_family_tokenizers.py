"""kvserve's tokenizer against llama.cpp's on gemma's and gpt-oss's vocabulary kinds: SentencePiece with
byte fallback and no space prefix (gemma), o200k byte-level BPE (gpt-oss, ``tokenizer.ggml.pre``
"gpt-4o"). Fixtures: tests/reference/family_tokenizers/KIND.json, llama-server's ``/tokenize`` of 59
texts (llama.cpp's reference corpus of tests/reference/smollm2 plus texts for these kinds' own rules)
three ways, on a GGUF of the family with the vocabulary (tests/tokenizer_vocabs.py; ``regen.py``
there makes them). Here the fixture's tokenizer keys are written into a GGUF and read by kvserve's
loader; every id must equal llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tokenizer_vocabs as tv
from kvserve.loaders.tokenizer import VOCAB_TYPE_BPE, VOCAB_TYPE_SPM, Tokenizer

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "family_tokenizers"


def _fixture(kind: str) -> dict:
    return json.loads((REFERENCE / f"{kind}.json").read_text())


@pytest.fixture(scope="module", params=["spm", "o200k"])
def kind(request, tmp_path_factory):
    fx = _fixture(request.param)
    path = tv.write_vocab_gguf(tmp_path_factory.mktemp("tok") / f"{request.param}.gguf", fx["arch"], fx["tokenizer"])
    return request.param, fx, Tokenizer.from_gguf_file(path)


def test_fixture_covers_the_corpus_and_the_kinds_rules(kind):
    name, fx, tok = kind
    assert [t["text"] for t in fx["texts"]] == tv.corpus()
    assert tok.vocab_type == {"spm": VOCAB_TYPE_SPM, "o200k": VOCAB_TYPE_BPE}[name]
    ids = [i for t in fx["texts"] for i in t["ids_no_special"]]
    n = len(fx["tokenizer"][2][3])  # tokenizer.ggml.tokens
    tokens = fx["tokenizer"][2][3]
    if name == "spm":  # byte fallback used (CJK, emoji), and pieces that start with the escaped space
        assert sum(tokens[i].startswith("<0x") for i in ids) > 100
        assert sum(tokens[i].startswith("\u2581") and len(tokens[i]) > 2 for i in ids) > 50
    else:  # merges that span what o200k's regex splits: the ids depend on the split
        assert sum(" " in tv.byte_level_text(tokens[i]).strip() for i in set(range(n)) - set(ids)) > 10
    assert len(set(ids)) > 200 and max(ids) < n


@pytest.mark.parametrize("way", ["ids", "ids_no_special", "ids_add_special"])
def test_ids_equal_llama_cpps(kind, way):
    _, fx, tok = kind
    add_special = way == "ids_add_special"
    parse_special = way != "ids_no_special"
    bad = [t["text"] for t in fx["texts"] if tok.encode(t["text"], add_special=add_special,
                                                        parse_special=parse_special) != t[way]]
    assert bad == []


def test_special_tokens_split_as_llama_cpps(kind):
    """The family's control tokens are one id each with parse_special, text without (spot check of
    what test_ids_equal_llama_cpps covers over the whole corpus)."""
    name, fx, tok = kind
    text = "<|start|>user<|message|>" if name == "o200k" else "<start_of_turn>user\n"
    row = next(t for t in fx["texts"] if t["text"].startswith(text))
    first = tok.encode(text.split(">")[0] + ">", parse_special=True)
    assert len(first) == 1 and row["ids"][0] == first[0]
    if name == "o200k":  # llama.cpp makes <|start|>, <|channel|>, <|message|>, <|constrain|> and (with
        # <|return|> and <|call|> present) <|end|> user-defined: matched without parse_special too
        assert row["ids_no_special"] == row["ids"] and first[0] == row["ids_no_special"][0]
        assert len(tok.encode("<|end|>", parse_special=False)) == 1
        assert len(tok.encode("<|return|>", parse_special=True)) == 1
        assert len(tok.encode("<|return|>", parse_special=False)) > 1
    else:
        assert len(row["ids_no_special"]) > len(row["ids"])
