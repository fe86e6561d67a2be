"""The base of every face's wire types (:mod:`kvserve.faces.openai_types`,
:mod:`kvserve.faces.llama_types`).

A wire type is a pydantic model whose fields are the JSON object's keys, declared in the
order the dialect writes them (llama-server's JSON library keeps insertion order, and its
clients and our tests read that order). One rule decides whether a key is in the JSON:

- a field without a default is always written (``None`` is written ``null``);
- a field with a default is written only when the face gave it, to the constructor or by
  assignment (``choice.logprobs = ...``); given as ``None`` it is written ``null``.

That is pydantic's ``exclude_unset``; :meth:`WireModel.wire` dumps with it. Models are
strict (no silent coercion: a float given for an ``int`` field is an error, an int given
for a ``float`` field becomes a float) and refuse unknown keys, so a typo in a face is an
error in its tests, not a wrong key on the wire.

Entries repeated per token (logprobs, ``/tokenize`` pieces) are TypedDicts with
:data:`LEAF_CONFIG` instead of models: building one is building a dict, and the enclosing
model validates them in one call into pydantic-core.

Cost per stream chunk (pydantic 2.14, timeit on this repository's 2-core CPU, build + ``.wire()``):
a chat chunk ~8 µs (the plain dict it replaced: ~0.5 µs; its JSON text, paid either way: ~5-7
µs); a ``/completion`` chunk ~4-7 µs; one with ``n_probs`` 10 ~15-20 µs (~35-50 µs with models
as leaves). Faces build with the validating constructor: ``model_construct`` is pure Python
and slower in pydantic 2.x (~15-18 µs for the same chat chunk). Bulk lists whose values come
straight from the tokenizer (``/tokenize``) are built with ``model_construct``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["LEAF_CONFIG", "WireModel"]

#: The config of the TypedDict leaves (entries repeated per token, such as logprobs): the same
#: strictness as :class:`WireModel`. A leaf is a plain dict, so it has no "unset" fields: every
#: key it holds is written, in the TypedDict's order (the enclosing model validates it).
LEAF_CONFIG = ConfigDict(extra="forbid", strict=True)


class WireModel(BaseModel):
    """A JSON object of one API dialect (see the module docstring for which keys are written)."""

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    def wire(self) -> dict[str, Any]:
        """The JSON object as Python values (dicts, lists, str, int, float, bool, None), keys in
        field order, unset optional fields left out; ready for ``json.dumps``."""
        return self.__pydantic_serializer__.to_python(self, exclude_unset=True)
