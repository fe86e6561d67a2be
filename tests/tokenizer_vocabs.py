"""Small vocabularies of the kinds gemma and gpt-oss use, for checking kvserve's tokenizer against
llama.cpp's on the same GGUF (tests/unit/test_family_tokenizers.py; fixtures and their generator in
tests/reference/family_tokenizers/).

* ``spm``: gemma's kind: SentencePiece (``tokenizer.ggml.model`` "llama") with byte fallback
  (``<0x00>``..``<0xFF>``), no space prefix (gemma's ``add_space_prefix`` false), scored pieces that
  hold the ``U+2581`` whitespace escape and whitespace runs, control tokens (``<start_of_turn>``...)
  and a user-defined one (``<start_of_image>``): 256 byte tokens plus the pieces an HF BPE trainer
  learns from :func:`training_text` (the real gemma vocabulary has 262,144 pieces; its splitting rules
  are these).
* ``o200k``: gpt-oss's kind: byte-level BPE with ``tokenizer.ggml.pre`` "gpt-4o" (llama.cpp's name
  for o200k's pre-tokenizer), merges learned without any pre-tokenizer so they cross the boundaries
  the o200k regex draws (a wrong split changes the ids), and gpt-oss's Harmony control tokens.

The vocabularies are trained once by tests/reference/family_tokenizers/regen.py and stored in the
fixtures (tokens, types, scores, merges), so the tests need no trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: texts beyond the llama.cpp reference corpus (tests/reference/smollm2/tokenize.jsonl) that exercise
#: o200k's and SentencePiece's own rules
EXTRA = ["DON'T STOP, I'M HERE; THEY'LL SEE", "XMLHttpRequest getHTTPResponseCode iPhone McDonald's",
         "path/to/file.txt\nnext/line/\n", "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant",
         "<|channel|>analysis<|message|>think<|end|><|return|>", "<start_of_turn>user\nhi<end_of_turn>\n",
         "<start_of_image> an image", "e\u0301 combining \u0301marks \u00e9", "  \u2581already escaped\u2581\u2581",
         "1234567 12 123 1234", "tab\t\tdouble", "ÀÉÎÕÜ àéîõü ŁódźŚ", "x" * 50 + " yy"]

SPM_SPECIAL = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 3), ("<start_of_turn>", 3),
               ("<end_of_turn>", 3), ("<start_of_image>", 4)]
O200K_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                 "<|end|>", "<|message|>", "<|call|>"]


def corpus() -> list[str]:
    """The texts tokenized: llama.cpp's reference corpus of tests/reference/smollm2 and :data:`EXTRA`."""
    lines = (TESTS / "reference" / "smollm2" / "tokenize.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines] + EXTRA


def training_text() -> list[str]:
    """What the vocabularies are learned from: the corpus (its non-Latin scripts, emoji and CJK left out
    so that byte fallback and byte-level pieces are exercised) three times."""
    keep = [t for t in corpus() if all(ord(c) < 0x370 or c == "\u2581" for c in t) and "<" not in t]
    return keep * 3


def train_spm() -> dict:
    """gemma-kind SentencePiece fields: {tokens, types, scores}."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    tok.train_from_iterator(training_text(), trainers.BpeTrainer(vocab_size=500, min_frequency=2,
                                                                 show_progress=False))
    spec = json.loads(tok.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    merged = {"".join(m if isinstance(m, list) else m.split(" ")): i for i, m in enumerate(spec["merges"])}
    tokens = [t for t, _ in SPM_SPECIAL] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in SPM_SPECIAL] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, _ in vocab:  # a merge's score falls with its rank; single characters below every merge
        tokens.append(piece)
        types.append(1)
        scores.append(-float(merged[piece]) if piece in merged else -float(len(merged) + len(tokens)))
    return {"tokens": tokens, "types": types, "scores": scores}


def train_o200k() -> dict:
    """gpt-oss-kind byte-level BPE fields: {tokens, types, merges}."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=800, min_frequency=2, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])] + O200K_SPECIAL
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    return {"tokens": tokens, "types": [1] * (len(tokens) - len(O200K_SPECIAL)) + [3] * len(O200K_SPECIAL),
            "merges": merges}


def byte_level_text(token: str) -> str:
    """A byte-level BPE token's text (GPT-2's byte-to-unicode table undone; invalid UTF-8 replaced)."""
    import tinymodel

    inv = {c: b for b, c in tinymodel.byte_to_unicode().items()}
    return bytes(inv[c] for c in token if c in inv).decode("utf-8", "replace")


def gguf_fields(kind: str, vocab: dict) -> list[list]:
    """The tokenizer keys of a GGUF of ``kind`` ("spm" / "o200k") as family_oracle.metadata lists them:
    [key, value type, array item type, value]. Special ids as gemma3's and gpt-oss's GGUFs set them."""
    out = [["tokenizer.ggml.tokens", "ARRAY", "STRING", vocab["tokens"]],
           ["tokenizer.ggml.token_type", "ARRAY", "INT32", vocab["types"]]]
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    if kind == "spm":
        out = [["tokenizer.ggml.model", "STRING", None, "llama"], ["tokenizer.ggml.pre", "STRING", None, "default"],
               *out, ["tokenizer.ggml.scores", "ARRAY", "FLOAT32", vocab["scores"]],
               ["tokenizer.ggml.bos_token_id", "UINT32", None, ids["<bos>"]],
               ["tokenizer.ggml.eos_token_id", "UINT32", None, ids["<eos>"]],
               ["tokenizer.ggml.unknown_token_id", "UINT32", None, ids["<unk>"]],
               ["tokenizer.ggml.padding_token_id", "UINT32", None, ids["<pad>"]],
               ["tokenizer.ggml.add_bos_token", "BOOL", None, True],
               ["tokenizer.ggml.add_eos_token", "BOOL", None, False],
               ["tokenizer.ggml.add_space_prefix", "BOOL", None, False]]
    else:
        out = [["tokenizer.ggml.model", "STRING", None, "gpt2"], ["tokenizer.ggml.pre", "STRING", None, "gpt-4o"],
               *out, ["tokenizer.ggml.merges", "ARRAY", "STRING", vocab["merges"]],
               ["tokenizer.ggml.bos_token_id", "UINT32", None, ids["<|startoftext|>"]],
               ["tokenizer.ggml.eos_token_id", "UINT32", None, ids["<|return|>"]],
               ["tokenizer.ggml.padding_token_id", "UINT32", None, ids["<|endoftext|>"]],
               ["tokenizer.ggml.add_bos_token", "BOOL", None, False]]
    return out


def write_vocab_gguf(path, arch: str, fields: list[list]) -> Path:
    """A GGUF holding only ``general.architecture`` and the tokenizer ``fields`` (what kvserve's
    tokenizer reads; no tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, vtype, sub, value in fields:
        w.add_key_value(key, value, gguf.GGUFValueType[vtype], None if sub is None else gguf.GGUFValueType[sub])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
