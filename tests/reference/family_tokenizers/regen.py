"""Regenerate llama.cpp's tokenizations for gemma's and gpt-oss's vocabulary kinds (the fixtures of
tests/unit/test_family_tokenizers.py).

Run from the repository root with the shared venv and llama-server built from the llama-cpp-python
sdist::

    python tests/reference/family_tokenizers/regen.py \\
        --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

For each kind of tests/tokenizer_vocabs.py ("spm": gemma3, "o200k": gpt-oss):

1. trains the vocabulary (tokenizers' BPE trainer; tests/tokenizer_vocabs.py);
2. writes a tiny random model of the family (tests/family_models.py, its embedding and head as wide
   as the vocabulary) as a GGUF with llama.cpp's names, its tokenizer keys replaced by the vocabulary's;
3. starts llama-server on it (127.0.0.1, a free port, stopped by pid) and records ``/tokenize`` of every
   corpus text three ways: ``add_special`` false with ``parse_special`` true and false, and
   ``add_special`` true;
4. writes ``KIND.json``: the tokenizer keys (all of them: the test writes them into a GGUF of its own)
   and the ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import importlib.util  # noqa: E402

import family_models as fmod  # noqa: E402
import family_oracle  # noqa: E402
import tokenizer_vocabs as tv  # noqa: E402

_spec = importlib.util.spec_from_file_location("llama_families_regen", HERE.parent / "llama_families" / "regen.py")
_families = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_families)
Server = _families.Server  # llama-server on a free loopback port, stopped by pid

#: kind -> (GGUF architecture, transformers model_type, config options of the tiny model)
KINDS = {
    "spm": ("gemma3", "gemma3_text", dict(num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=16)),
    "o200k": ("gpt-oss", "gpt_oss", dict(num_hidden_layers=2, sliding_window=4, num_local_experts=4,
                                         num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 128,
                                                          "beta_fast": 32.0, "beta_slow": 1.0})),
}


def regen(kind: str, root: Path, out: Path, tmp: Path) -> dict:
    vocab = tv.train_spm() if kind == "spm" else tv.train_o200k()
    arch, model_type, cfg = KINDS[kind]
    model = fmod.build(model_type, seed=1, vocab_size=len(vocab["tokens"]), **cfg)
    plain = fmod.save_gguf(model, tmp / f"{kind}.plain.gguf", arch)
    fields = [f for f in family_oracle.metadata(plain)
              if not f[0].startswith("tokenizer.") and not f[0].endswith(".vocab_size")]
    fields += tv.gguf_fields(kind, vocab)
    path = family_oracle.write_like(tmp / f"{kind}.gguf", arch, fields, plain)
    server = Server(root / "build" / "bin" / "llama-server", path)
    try:
        texts = []
        for text in tv.corpus():
            ids = {}
            for name, body in (("ids", dict(add_special=False, parse_special=True)),
                               ("ids_no_special", dict(add_special=False, parse_special=False)),
                               ("ids_add_special", dict(add_special=True, parse_special=True))):
                ids[name] = server.post("/tokenize", content=text, **body)["tokens"]
            texts.append({"text": text, **ids})
    finally:
        server.stop()
    fixture = {"kind": kind, "arch": arch, "tokenizer": tv.gguf_fields(kind, vocab), "texts": texts}
    (out / f"{kind}.json").write_text(json.dumps(fixture, separators=(",", ":"), ensure_ascii=False) + "\n")
    return {"kind": kind, "n_vocab": len(vocab["tokens"]), "texts": len(texts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--kinds", nargs="*", default=list(KINDS))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.kinds:
            print(json.dumps(regen(kind, a.llama_cpp.resolve(), a.out, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
