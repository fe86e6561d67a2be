"""Every dialect's output-constraint fields -> one :class:`ConstraintSpec`.

Fields read, by face (``constraint_from_body``'s ``face`` argument):

- ``"llama"`` (``/completion``): ``grammar`` (GBNF), ``json_schema`` (object),
  ``response_format``;
- ``"openai"`` (``/v1/chat/completions``, ``/v1/completions``): ``response_format``
  (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {name, schema,
  strict}}``), vLLM ``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``; ``structural_tag`` is refused), vLLM's legacy ``guided_json``
  / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and llama-server's ``grammar``
  / ``json_schema`` (llama-server reads those on its OpenAI endpoints too);
- ``"ollama"``: ``format`` (``"json"`` or a JSON-schema object).

A request may carry one constraint; two (say ``grammar`` and ``response_format``) is an
:class:`kvserve.errors.InvalidInputError` (a 400), as is anything malformed. JSON schemas are checked here with
:func:`kvserve.structured.schema.check_schema`, so a keyword the backend would ignore is a
400 naming the field, the keyword and where it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidInputError
from kvserve.jsonvalues import json_type as _type_name
from kvserve.structured.schema import SchemaError, check_schema, check_size

__all__ = ["KINDS", "VLLM_MULTIPLE", "VLLM_NONE", "ConstraintSpec", "constraint_from_body", "schema_spec"]

#: the constraint kinds.
KINDS = ("grammar", "json_schema", "json_object", "regex", "choice")

#: vLLM's texts (StructuredOutputsParams.__post_init__), seed 002 Example 9.
VLLM_MULTIPLE = "You can only use one kind of structured outputs constraint but multiple are specified"
VLLM_NONE = "You must use one kind of structured outputs constraint but none are specified"

#: llama-server's text when both ``grammar`` and ``json_schema`` are given.
LLAMA_BOTH = 'Either "json_schema" or "grammar" can be specified, but not both'

_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class ConstraintSpec:
    """One output constraint, dialect-free and hashable (the compile cache key).

    Attributes:
        kind: ``"grammar"`` | ``"json_schema"`` | ``"json_object"`` | ``"regex"`` | ``"choice"``.
        value: by kind: GBNF text; the schema as compact JSON text (key order kept: it is the
            order properties are generated in); ``""``; the regular expression; the choices
            as a JSON array of strings.

    Raises:
        ValueError: an unknown kind.
    """

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")


def _bad(field: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"Field '{field}': {msg}")


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def tuple_items(schema: Any) -> Any:
    """``schema`` with every draft-4 tuple ``"items": [A, B]`` written as ``"prefixItems": [A, B],
    "items": false, "minItems": 2`` (exactly those items, as llama.cpp's json-schema-to-grammar reads the
    array form); the input is not changed. Other values are returned as they are."""
    if isinstance(schema, list):
        return [tuple_items(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else tuple_items(v)) for k, v in schema.items()}
    if isinstance(out.get("items"), list) and "prefixItems" not in out:
        out["prefixItems"], out["items"] = out["items"], False
        out.setdefault("minItems", len(out["prefixItems"]))
    return out


def schema_spec(schema: Any, field: str) -> ConstraintSpec:
    """A ``json_schema`` spec from a parsed schema, checked for keywords the backend cannot enforce.

    Args:
        schema: dict (or bool) as parsed from the request.
        field: the request field, for error messages (``response_format.json_schema.schema``).

    Raises:
        InvalidInputError: ``Field '<field>': ...`` for a non-object or an unsupported keyword
            (a face answers 400).
    """
    if not isinstance(schema, (dict, bool)):
        raise _bad(field, f"type must be object, but is {_type_name(schema)}")
    try:
        check_size(schema)  # before any recursive walk (tuple_items): a 600-deep schema is a 400, not a RecursionError
        schema = tuple_items(schema)
        check_schema(schema)
    except SchemaError as e:
        raise _bad(field, str(e)) from None
    return ConstraintSpec("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def _schema_from_text_or_object(v: Any, field: str) -> ConstraintSpec:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise _bad(field, f"not valid JSON: {e}") from None
    return schema_spec(v, field)


def _string(v: Any, field: str, what: str) -> str:
    if not isinstance(v, str):
        raise _bad(field, f"type must be string, but is {_type_name(v)}")
    if not v:
        raise _bad(field, f"the {what} is empty")
    return v


def _choice(v: Any, field: str) -> ConstraintSpec:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        raise _bad(field, "must be a non-empty array of strings")
    return ConstraintSpec("choice", json.dumps(v, ensure_ascii=False))


def _grammar_field(body: dict) -> ConstraintSpec | None:
    g = body.get("grammar")
    if g is None or g == "":
        return None
    if not isinstance(g, str):
        raise _bad("grammar", f"type must be string, but is {_type_name(g)}")
    return ConstraintSpec("grammar", g)


def _json_schema_field(body: dict) -> ConstraintSpec | None:
    s = body.get("json_schema")
    if s is None:
        return None
    return schema_spec(s, "json_schema")


def _response_format(body: dict) -> ConstraintSpec | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format", f"type must be object, but is {_type_name(rf)}")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:  # llama-server's extension
            return schema_spec(rf["schema"], "response_format.schema")
        return ConstraintSpec("json_object", "")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if js is None:
            js = {}
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", f"type must be object, but is {_type_name(js)}")
        schema = js.get("schema", {}) if js.get("schema") is not None else {}
        return schema_spec(schema, "response_format.json_schema.schema")
    if kind == "structural_tag":
        raise _bad("response_format", "type 'structural_tag' is not supported yet")
    raise _bad("response_format", f'type must be one of "text", "json_object" or "json_schema", but got: {kind}')


def _vllm_group(members: dict[str, Any], names: dict[str, str]) -> ConstraintSpec | None:
    """One of vLLM's StructuredOutputsParams kinds; ``names`` maps kind -> request field name."""
    given = [k for k in _VLLM_KINDS if members.get(k) is not None]
    if len(given) > 1:
        raise InvalidInputError(VLLM_MULTIPLE)
    if not given:
        raise InvalidInputError(VLLM_NONE)
    kind = given[0]
    v, field = members[kind], names[kind]
    if kind == "json":
        return _schema_from_text_or_object(v, field)
    if kind == "regex":
        return ConstraintSpec("regex", _string(v, field, "regular expression"))
    if kind == "choice":
        return _choice(v, field)
    if kind == "grammar":
        return ConstraintSpec("grammar", _string(v, field, "grammar"))
    if kind == "json_object":
        if not isinstance(v, bool):
            raise _bad(field, f"type must be boolean, but is {_type_name(v)}")
        return ConstraintSpec("json_object", "") if v else None
    raise _bad(field, "structural tags are not supported yet")


def _structured_outputs(body: dict) -> ConstraintSpec | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("structured_outputs", f"type must be object, but is {_type_name(so)}")
    return _vllm_group(so, {k: f"structured_outputs.{k}" for k in _VLLM_KINDS})


def _guided(body: dict) -> ConstraintSpec | None:
    members = {kind: body[f] for f, kind in _GUIDED.items() if body.get(f) is not None}
    if not members:
        return None
    names = {kind: f for f, kind in _GUIDED.items()}
    return _vllm_group(members, names)


def _ollama_format(body: dict) -> ConstraintSpec | None:
    f = body.get("format")
    if f is None or f == "":
        return None
    if f == "json":
        return ConstraintSpec("json_object", "")
    if isinstance(f, dict):
        return schema_spec(f, "format")
    raise _bad("format", 'must be "json" or a JSON schema object')


_SOURCES = {
    "llama": (("grammar", _grammar_field), ("json_schema", _json_schema_field), ("response_format", _response_format)),
    "openai": (("grammar", _grammar_field), ("json_schema", _json_schema_field), ("response_format", _response_format),
               ("structured_outputs", _structured_outputs), ("guided_*", _guided)),
    "ollama": (("format", _ollama_format),),
}


def constraint_from_body(body: dict, face: str) -> ConstraintSpec | None:
    """The request's output constraint, or None when it has none.

    Args:
        body: the request JSON object.
        face: ``"llama"`` (``/completion``), ``"openai"`` (chat and legacy completions) or
            ``"ollama"`` (``/api/chat``, ``/api/generate``); see the module docstring for the
            fields each reads.

    Returns:
        A ConstraintSpec, or None (no constraint, ``response_format`` ``text``, empty
        ``grammar``, ``structured_outputs.json_object: false``).

    Raises:
        InvalidInputError: (a face answers 400) a malformed field, a schema keyword the backend
            cannot enforce, two constraints in one request, vLLM's "multiple"/"none" cases (its
            exact texts) and ``structural_tag`` (not supported yet).
        ValueError: an unknown ``face``.
    """
    if face not in _SOURCES:
        raise ValueError(f"unknown face {face!r}")
    found: list[tuple[str, ConstraintSpec]] = []
    for name, read in _SOURCES[face]:
        spec = read(body)
        if spec is not None:
            found.append((name, spec))
    if len(found) > 1:
        names = [n for n, _ in found]
        if names[:2] == ["grammar", "json_schema"]:
            raise InvalidInputError(LLAMA_BOTH)
        raise InvalidInputError(f"only one output constraint may be given, but the request has both '{names[0]}' "
                                f"and '{names[1]}'")
    return found[0][1] if found else None
