"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a tiny test model with one change: the vocabulary.

Usage: ``python convert_tiny.py LLAMA_CPP_DIR --outtype f32 --outfile OUT.gguf HF_DIR`` (after
LLAMA_CPP_DIR, the converter's own arguments).

The tiny models of tests/family_models.py share tests/tinymodel.py's 301-token byte-level BPE
vocabulary. The converter identifies a BPE pre-tokenizer by the hash of its tokenization of a fixed
text and refuses hashes it does not know, and some families' ``set_vocab`` look for a SentencePiece
``tokenizer.model`` first (qwen, gemma). Here every causal family's ``set_vocab`` is the converter's
own ``_set_vocab_gpt2`` (tokens, types, merges, special ids and chat template from tokenizer.json and
tokenizer_config.json) with the pre-tokenizer named ``smollm`` (the tiny vocabulary's); nomic-bert
keeps its WordPiece ``set_vocab``, the pre-tokenizer named ``default``. Everything else
(hyperparameters, tensor names, permutations, splits, types) is the converter's.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(root))
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    import convert_hf_to_gguf as conv
    from conversion import base

    def get_model_class(name, mmproj=False):
        cls = original(name, mmproj=mmproj)
        if "Bert" in name:  # the WordPiece vocabulary; its pre-tokenizer hash is unknown too
            cls.get_vocab_base_pre = lambda self, tokenizer: "default"
            return cls

        # mistral3's class converts through an inner one (``impl``): patch every TextModel in reach
        for c in [cls, *(v for v in vars(cls).values() if isinstance(v, type) and issubclass(v, base.TextModel))]:
            c.get_vocab_base_pre = lambda self, tokenizer: "smollm"
            c.set_vocab = base.TextModel._set_vocab_gpt2
        return cls

    original = conv.get_model_class
    conv.get_model_class = get_model_class
    conv.main()


if __name__ == "__main__":
    main()
