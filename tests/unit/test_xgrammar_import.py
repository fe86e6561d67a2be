"""xgrammar without transformers (issue #29, a first request as fast as the tenth): the grammar
warm-up thread that starts beside the first requests must not import transformers (~1.4 s of a
core holding the GIL), and structured outputs still work; a caller that has transformers still gets
xgrammar's ``TokenizerInfo.from_huggingface``. Each check runs in a fresh interpreter (the test
process may have imported transformers already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_GRAMMAR = r'''
import json, sys
from kvserve.structured.backend import GrammarBackend
from kvserve.structured.spec import ConstraintSpec


class Bytes:
    """ids 0-255: one byte each; 256: the end-of-generation token"""
    eog_token_ids = frozenset({256})

    def __len__(self):
        return 257

    def token_bytes(self, i, special=True):
        return b"</s>" if i == 256 else bytes([i])


be = GrammarBackend(Bytes(), 257)
be._get_compiler()  # what the server's warm-up thread does
c = be.constraint(ConstraintSpec("json_schema", json.dumps(
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
allowed = []
for b in b'{"n":12}':
    mask = c.mask()
    allowed.append(int(mask.sum()))
    assert mask[b], chr(b)
    assert c.accept_token(b)
end = c.mask()
print(json.dumps({"transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "first_allowed": allowed[0], "eos_allowed_at_end": bool(end[256]),
                  "bytes_allowed_at_end": int(end[:256].sum())}))
'''

_HF = r'''
import json
from kvserve.structured.xgr import xgrammar_module
xgr = xgrammar_module()
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>")))
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=3)
print(json.dumps({"vocab_size": info.vocab_size, "decoded": [t.decode() for t in info.decoded_vocab[:2]],
                  "fast": isinstance(tok, xgr.tokenizer_info.PreTrainedTokenizerFast),
                  "not_fast": isinstance(object(), xgr.tokenizer_info.PreTrainedTokenizerFast)}))
'''


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grammar_backend_compiles_and_masks_without_importing_transformers():
    """Before: xgrammar's import pulled in transformers (``transformers`` and ~150 of its modules in
    sys.modules); the masks are those of the schema over a byte vocabulary."""
    assert _run(_GRAMMAR) == {"transformers": [], "first_allowed": 1, "eos_allowed_at_end": True,
                              "bytes_allowed_at_end": 0}


def test_from_huggingface_still_works_where_transformers_is_imported_later():
    """The stand-in classes xgrammar was imported with answer type checks with transformers' own
    classes, so ``TokenizerInfo.from_huggingface`` still reads a real fast tokenizer."""
    assert _run(_HF) == {"vocab_size": 3, "decoded": ["a", "b"], "fast": True, "not_fast": False}
