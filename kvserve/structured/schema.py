"""Which JSON-schema keywords the grammar backend (xgrammar 0.2.9) enforces, and a check that
refuses every schema it would enforce only in part.

xgrammar turns a JSON schema into a grammar, but it silently drops some keywords: a schema
with ``uniqueItems`` compiles and the model may still repeat items. A client that relies on
the constraint would get output that fails its own validator, so :func:`check_schema` walks
the schema (following local ``$ref`` s) and refuses such keywords with a message that names
the keyword and where it is. Each rule below was found by compiling the keyword and feeding
the matcher an instance that breaks it.

Enforced (output always validates):

- ``type`` (a name or a list), ``enum``, ``const``, ``nullable`` (OpenAPI);
- objects: ``properties``, ``required`` (names declared in ``properties``),
  ``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``,
  ``minProperties``, ``maxProperties``. As in llama.cpp's converter and vLLM's default
  (xgrammar ``strict_mode``), an object that lists ``properties`` gets no other properties
  unless ``additionalProperties`` allows them; ``{"type": "object"}`` alone allows any object;
- arrays: ``items``, ``prefixItems``, ``minItems``, ``maxItems``, ``unevaluatedItems``;
- strings: ``minLength``, ``maxLength`` (in characters; such strings are generated
  without escape sequences), ``pattern`` (matched against the whole string, as if anchored:
  a subset of what JSON Schema allows; ``^``/``$`` only at its ends; it may not produce
  a quote, a backslash or a control character except by excluding them in ``[^...]``, see
  :mod:`kvserve.structured.regex`), ``format`` one of :data:`FORMATS`;
- numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (numbers,
  not draft-4 booleans); ``multipleOf`` on ``"type": "integer"`` with a whole number;
- composition: ``anyOf``; ``oneOf`` whose branches cannot both match (distinct types,
  disjoint ``const``/``enum`` values, or a shared property with disjoint ``const``/``enum``
  values, i.e. a discriminator); ``allOf`` with one entry; ``$ref`` to ``#`` or ``#/...``
  (``$defs`` or ``definitions``, declared before or after use, recursion allowed);
- annotations are accepted and have no effect: ``title``, ``description``, ``default``,
  ``examples``, ``$comment``, ``$schema``, root ``$id``, ``readOnly``, ``writeOnly``,
  ``deprecated``, ``contentEncoding``, ``contentMediaType``, ``contentSchema``,
  ``discriminator``; unknown keywords too (JSON Schema treats them as annotations).

Refused (400) because xgrammar would ignore them or produce output that violates them:
``not``, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``,
``dependencies``, ``contains``/``minContains``/``maxContains``, ``propertyNames``,
``uniqueItems: true``, ``allOf`` with several entries, ``$dynamicRef``/``$recursiveRef``,
``$ref`` that is not a local JSON pointer, ``$id`` below the root, ``format`` values outside
:data:`FORMATS`, ``multipleOf`` on numbers or with a fraction, ``pattern``/``format`` together
with ``minLength``/``maxLength`` (or with each other), ``required`` names missing from
``properties``, validation keywords beside ``$ref``/``allOf``/``enum``/``const``/``anyOf``/
``oneOf`` (xgrammar keeps only the composition; ``type`` is allowed beside ``enum``/``const``
when every value has that type, and beside ``anyOf``/``oneOf`` when every branch declares a
type within it), type-specific keywords such as ``minimum`` in a schema without ``type``
(unless ``properties``/``items`` make the type clear), ``multipleOf`` together with a
range (``minimum``...), and an invalid or unsafe ``pattern`` (see above).

Size: a schema nested deeper than :data:`MAX_SCHEMA_DEPTH` objects/arrays, or holding more
than :data:`MAX_SCHEMA_NODES` of them, is refused before anything walks or compiles it (a
600-deep ``items`` chain would otherwise exhaust Python's recursion in the walk, and a 400-deep
one costs seconds in the compiler).
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvserve.structured.regex import RegexError, check_json_pattern
from kvserve.structured.xgr import xgrammar_module
from kvserve.structured.xgrammar_text import clean_error

__all__ = ["FORMATS", "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "SchemaError", "check_schema", "check_size"]

#: deepest nesting of JSON objects/arrays in a schema (the root object is depth 1); a schema
#: level is one or two of them (``items``: one, ``properties/x``: two). Real schemas stay
#: far below it (the deepest OpenAI allows for structured outputs is 10 levels).
MAX_SCHEMA_DEPTH = 128
#: most JSON objects/arrays in one schema (a 150-tool set with 8 arguments each has ~5,000).
MAX_SCHEMA_NODES = 100_000

#: ``format`` values xgrammar enforces (each checked with a non-matching string).
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template", "uuid",
    "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer",
})

#: keywords xgrammar ignores (or turns into output that breaks them), refused everywhere.
_REFUSED = {
    "not": "it is ignored",
    "if": "conditional schemas are ignored",
    "then": "conditional schemas are ignored",
    "else": "conditional schemas are ignored",
    "dependentRequired": "it is ignored",
    "dependentSchemas": "it is ignored",
    "dependencies": "it is ignored",
    "contains": "it is ignored",
    "minContains": "'contains' is ignored",
    "maxContains": "'contains' is ignored",
    "propertyNames": "it is not applied correctly",
    "$dynamicRef": "dynamic references are not resolved",
    "$recursiveRef": "recursive references are not resolved",
}

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor",
    "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "readOnly", "writeOnly", "deprecated",
    "contentEncoding", "contentMediaType", "contentSchema", "discriminator", "$defs", "definitions",
})

_NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING_KW = ("minLength", "maxLength", "pattern", "format")
_ARRAY_KW = ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems")
_OBJECT_KW = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
              "maxProperties", "unevaluatedProperties")
_TYPED_KW = _NUMBER_KW + _STRING_KW + _ARRAY_KW + _OBJECT_KW
#: keywords after which xgrammar ignores sibling validation keywords.
_EXCLUSIVE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})


class SchemaError(ValueError):
    """The schema uses something the grammar backend cannot enforce; the message says what and where."""


def _where(path: str) -> str:
    return "#" + path if path else "the root"


def _type_set(v: Any) -> set[str] | None:
    if isinstance(v, str):
        return {v}
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        return set(v)
    return None


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _fits(value_type: str, types: set[str]) -> bool:
    return value_type in types or (value_type == "integer" and "number" in types)


def _pointer(root: Any, ref: str) -> Any:
    """The subschema ``ref`` (``#`` or ``#/a/b``) points to; KeyError when it does not resolve."""
    node = root
    if ref in ("#", "#/"):
        return node
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def _values(s: dict) -> list | None:
    """The values a schema allows when it is a ``const``/``enum`` one, else None."""
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return list(s["enum"])
    return None


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


class _Walker:
    def __init__(self, root: Any):
        self.root = root
        self.seen: set[int] = set()

    def deref(self, s: Any) -> Any:
        """Follow ``$ref`` chains of a branch (for oneOf's disjointness test)."""
        hops = 0
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and hops < 32:
            try:
                s = _pointer(self.root, s["$ref"])
            except KeyError:
                return s
            hops += 1
        return s

    def branch_types(self, s: Any) -> set[str] | None:
        s = self.deref(s)
        if not isinstance(s, dict):
            return None
        ts = _type_set(s.get("type"))
        if ts is not None:
            return ts
        vals = _values(s)
        if vals is not None:
            return {_json_type(v) for v in vals}
        return None

    def disjoint(self, a: Any, b: Any) -> bool:
        """True when no instance can match both branches (cheap, conservative)."""
        a, b = self.deref(a), self.deref(b)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        ta, tb = self.branch_types(a), self.branch_types(b)
        if ta is not None and tb is not None and not any(
                x == y or {x, y} == {"integer", "number"} for x in ta for y in tb):
            return True
        va, vb = _values(a), _values(b)
        if va is not None and vb is not None:
            return not ({_canon(v) for v in va} & {_canon(v) for v in vb})
        pa, pb = a.get("properties"), b.get("properties")
        if isinstance(pa, dict) and isinstance(pb, dict):
            req_a, req_b = set(a.get("required") or ()), set(b.get("required") or ())
            for name in set(pa) & set(pb) & req_a & req_b:
                xa, xb = self.deref(pa[name]), self.deref(pb[name])
                if isinstance(xa, dict) and isinstance(xb, dict):
                    va, vb = _values(xa), _values(xb)
                    if va is not None and vb is not None and not ({_canon(v) for v in va} & {_canon(v) for v in vb}):
                        return True
        return False

    def walk(self, s: Any, path: str) -> None:
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            raise SchemaError(f"the schema at {_where(path)} must be an object or a boolean")
        if id(s) in self.seen:
            return
        self.seen.add(id(s))
        for kw, why in _REFUSED.items():
            if kw in s:
                raise SchemaError(f"keyword '{kw}' at {_where(path)} is not supported: {why} by the grammar backend")
        if s.get("uniqueItems") is True:
            raise SchemaError(f"keyword 'uniqueItems' at {_where(path)} is not supported: it is ignored by the "
                              "grammar backend")
        if "$id" in s and path:
            raise SchemaError(f"keyword '$id' at {_where(path)} is not supported: only the root may have one")
        for kw in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(s.get(kw), bool):
                raise SchemaError(f"keyword '{kw}' at {_where(path)} must be a number (the draft-4 boolean form "
                                  "is not supported)")
        self.check_siblings(s, path)
        self.check_typed(s, path)
        self.check_strings(s, path)
        self.check_one_of(s, path)
        if "multipleOf" in s:
            m = s["multipleOf"]
            if s.get("type") != "integer" or isinstance(m, bool) or not isinstance(m, (int, float)) \
                    or not math.isfinite(m) or m <= 0 or not float(m).is_integer():
                raise SchemaError(f"keyword 'multipleOf' at {_where(path)} is only supported with \"type\": "
                                  "\"integer\" and a positive whole number")
            rng = [k for k in _NUMBER_KW if k in s and k != "multipleOf"]
            if rng:
                raise SchemaError(f"keyword 'multipleOf' with '{rng[0]}' at {_where(path)} is not supported: the "
                                  "grammar backend would ignore 'multipleOf'")
        props = s.get("properties")
        req = s.get("required")
        if isinstance(req, list):
            declared = props if isinstance(props, dict) else {}
            missing = [r for r in req if r not in declared]
            if missing:
                raise SchemaError(f"'required' at {_where(path)} names {missing[0]!r}, which is not declared in "
                                  "'properties' (the grammar backend would not require it)")
        self.walk_children(s, path)

    def check_siblings(self, s: dict, path: str) -> None:
        excl = [k for k in _EXCLUSIVE if k in s]
        if not excl:
            return
        if "$ref" in s:
            ref = s["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise SchemaError(f"'$ref' {ref!r} at {_where(path)} is not supported: only local references "
                                  "('#' or '#/...') are")
            try:
                _pointer(self.root, ref)
            except KeyError:
                raise SchemaError(f"'$ref' {ref!r} at {_where(path)} does not resolve") from None
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) != 1:
            raise SchemaError(f"keyword 'allOf' at {_where(path)} is only supported with one entry (the grammar "
                              "backend does not merge several)")
        others = [k for k in s if k not in _ANNOTATIONS and k not in _EXCLUSIVE and k != "nullable"]
        if len(excl) > 1:
            raise SchemaError(f"keywords {excl[0]!r} and {excl[1]!r} together at {_where(path)} are not supported: "
                              f"the grammar backend would ignore {excl[1]!r}")
        kw = excl[0]
        for o in others:
            if o == "type" and kw in ("enum", "const"):
                ts = _type_set(s["type"])
                for v in _values(s) or []:
                    if ts is not None and not _fits(_json_type(v), ts):
                        raise SchemaError(f"'{kw}' value {json.dumps(v)} at {_where(path)} does not have the "
                                          f"type {s['type']!r}")
                continue
            if o == "type" and kw in ("anyOf", "oneOf") and isinstance(s[kw], list):
                ts = _type_set(s["type"])
                if ts is not None and all(
                        (bt := self.branch_types(b)) is not None and all(_fits(t, ts) for t in bt) for b in s[kw]):
                    continue
            if o in _TYPED_KW or o == "type":
                raise SchemaError(f"keyword '{o}' beside '{kw}' at {_where(path)} is not supported: the grammar "
                                  f"backend would ignore it (move it into the '{kw}' schema(s))")

    def check_typed(self, s: dict, path: str) -> None:
        if "type" in s or any(k in s for k in _EXCLUSIVE):
            return
        if "properties" in s or "items" in s or "prefixItems" in s or "additionalProperties" in s:
            return  # xgrammar infers object / array
        for k in _TYPED_KW:
            if k in s and not (k == "uniqueItems" and s[k] is False):
                raise SchemaError(f"keyword '{k}' at {_where(path)} needs a 'type' in the same schema (without one "
                                  "the grammar backend ignores it)")

    def check_strings(self, s: dict, path: str) -> None:
        fmt = s.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise SchemaError(f"'format' {fmt!r} at {_where(path)} is not supported (supported: "
                              f"{', '.join(sorted(FORMATS))})")
        lengths = [k for k in ("minLength", "maxLength") if k in s]
        if "pattern" in s and ("format" in s or lengths):
            other = "format" if "format" in s else lengths[0]
            raise SchemaError(f"'pattern' with '{other}' at {_where(path)} is not supported: the grammar backend "
                              f"would ignore '{other}'")
        if "format" in s and lengths:
            raise SchemaError(f"'format' with '{lengths[0]}' at {_where(path)} is not supported: the grammar "
                              f"backend would ignore '{lengths[0]}'")
        if "pattern" in s:
            _check_regex(s["pattern"], f"'pattern' at {_where(path)}")
        pp = s.get("patternProperties")
        if isinstance(pp, dict):
            for key in pp:
                _check_regex(key, f"'patternProperties' key at {_where(path)}")

    def check_one_of(self, s: dict, path: str) -> None:
        if isinstance(s.get("oneOf"), list):
            branches = s["oneOf"]
            for i in range(len(branches)):
                for j in range(i + 1, len(branches)):
                    if not self.disjoint(branches[i], branches[j]):
                        raise SchemaError(
                            f"'oneOf' at {_where(path)}: branches {i} and {j} may both match, and the grammar backend "
                            "enforces oneOf as anyOf; use anyOf, or make the branches disjoint (different types, or "
                            "a required property with different 'const' values)")

    def walk_children(self, s: dict, path: str) -> None:
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s and (not isinstance(s[key], list) or not s[key]):
                raise SchemaError(f"'{key}' at {_where(path)} must be a non-empty array (an empty one matches "
                                  "nothing)")
        for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
            v = s.get(key)
            if key in s and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(f"'{key}' at {_where(path)} must be a non-negative integer, got {v!r}")
        for key in ("properties", "patternProperties"):
            d = s.get(key)
            if isinstance(d, dict):
                for name, sub in d.items():
                    self.walk(sub, f"{path}/{key}/{_escape(name)}")
        for key in ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems"):
            if isinstance(s.get(key), (dict, bool)):
                self.walk(s[key], f"{path}/{key}")
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            lst = s.get(key)
            if isinstance(lst, list):
                for i, sub in enumerate(lst):
                    self.walk(sub, f"{path}/{key}/{i}")
        ref = s.get("$ref")
        if isinstance(ref, str):
            self.walk(_pointer(self.root, ref), ref[1:])


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _check_regex(pattern: Any, where: str) -> None:
    if not isinstance(pattern, str):
        raise SchemaError(f"{where} must be a string")
    try:
        check_json_pattern(pattern)
    except RegexError as e:
        raise SchemaError(f"{where} ({pattern!r}) is not supported: {e}") from None
    xgr = xgrammar_module()
    try:
        xgr.Grammar.from_regex(pattern)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
        raise SchemaError(f"{where} is not a valid regular expression ({pattern!r}): {clean_error(e)}") from None


def check_size(schema: Any) -> None:
    """Refuse a schema nested deeper than :data:`MAX_SCHEMA_DEPTH` or holding more than
    :data:`MAX_SCHEMA_NODES` objects/arrays (iterative: any depth is measured safely).

    Raises:
        SchemaError: naming the limit.
    """
    stack = [(schema, 1)]
    nodes = 0
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects "
                              "and arrays)")
        if nodes > MAX_SCHEMA_NODES:
            raise SchemaError(f"the schema is too large (more than {MAX_SCHEMA_NODES} objects and arrays)")
        stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))


def check_schema(schema: Any) -> None:
    """Refuse a JSON schema the grammar backend would not fully enforce.

    Args:
        schema: the parsed schema (dict or bool).

    Raises:
        SchemaError: naming the keyword and its location (``#/properties/x``); see the module
            docstring for the rules; or a schema over :data:`MAX_SCHEMA_DEPTH` /
            :data:`MAX_SCHEMA_NODES`.
    """
    check_size(schema)
    _Walker(schema).walk(schema, "")
