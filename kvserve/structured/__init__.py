"""Structured outputs: constrained sampling with xgrammar (grammars, JSON schemas, regex, choices).

- :mod:`kvserve.structured.spec`: request fields of every dialect -> :class:`ConstraintSpec`;
- :mod:`kvserve.structured.schema`: which JSON-schema keywords are enforced (the rest is refused);
- :mod:`kvserve.structured.gbnf`: llama.cpp GBNF -> xgrammar EBNF;
- :mod:`kvserve.structured.regex`: which regular expressions are accepted, and Python's ``.``;
- :mod:`kvserve.structured.xgrammar_text`: xgrammar's error texts, cleaned for a client;
- :mod:`kvserve.structured.xgr`: imports xgrammar without transformers (which it needs only for HF hooks);
- :mod:`kvserve.structured.backend`: compile cache and the per-request matcher (the engine's
  ``Request.grammar`` hook).

Imports go one way, down this list (imports inside functions included)::

    backend -> spec -> schema -> regex, xgrammar_text, xgr
    backend -> gbnf, regex, schema, xgrammar_text, xgr
    batch -> xgr

``spec`` and ``schema`` never import ``backend``. Nothing here imports ``kvserve.faces`` or
``kvserve.serving``: malformed input raises :class:`kvserve.errors.InvalidInputError`, which a
face answers with 400 (``tests/unit/test_layering.py`` checks both rules).

Memory: a :class:`GrammarBackend` (one per loaded model) holds the tokenizer, xgrammar's
TokenizerInfo and its compile cache; nothing at module level does, so they go with the backend
when its model is unloaded.
"""

from kvserve.structured.backend import GrammarBackend, GrammarConstraint
from kvserve.structured.spec import ConstraintSpec, constraint_from_body

__all__ = ["ConstraintSpec", "GrammarBackend", "GrammarConstraint", "constraint_from_body"]
