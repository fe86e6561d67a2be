"""Structured outputs: constrained sampling with xgrammar (grammars, JSON schemas, regex, choices).

- :mod:`kvserve.structured.spec`: request fields of every dialect -> :class:`ConstraintSpec`;
- :mod:`kvserve.structured.schema`: which JSON-schema keywords are enforced (the rest is a 400);
- :mod:`kvserve.structured.gbnf`: llama.cpp GBNF -> xgrammar EBNF;
- :mod:`kvserve.structured.backend`: compile cache and the per-request matcher (the engine's
  ``Request.grammar`` hook).
"""

from kvserve.structured.backend import GrammarBackend, GrammarConstraint
from kvserve.structured.spec import ConstraintSpec, constraint_from_body

__all__ = ["ConstraintSpec", "GrammarBackend", "GrammarConstraint", "constraint_from_body"]
