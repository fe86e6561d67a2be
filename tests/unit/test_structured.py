"""Structured outputs: request fields of every dialect, the JSON-schema check, GBNF translation,
the xgrammar backend (cache, masks, control tokens) and constrained generation in the engine
(tiny random model and SmolLM2, seed 000 Example 12 and seed 002 Example 9)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.errors import InvalidInputError
from kvserve.faces.api_error import ApiError
from kvserve.loaders.tokenizer import Tokenizer
from kvserve.models.build import load_files
from kvserve.structured.backend import GrammarBackend, bound_numbers, clean_error
from kvserve.structured.gbnf import GbnfError, gbnf_to_ebnf
from kvserve.structured.schema import SchemaError, check_schema
from kvserve.structured.spec import (
    LLAMA_BOTH,
    VLLM_MULTIPLE,
    VLLM_NONE,
    ConstraintSpec,
    constraint_from_body,
)

FILE_INFO = {
    "type": "object",
    "properties": {"file": {"type": "string", "maxLength": 12},
                   "lines": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["file", "lines"], "additionalProperties": False,
}
LOCATION = {"type": "object", "properties": {"file": {"type": "string"}, "line": {"type": "integer"}},
            "required": ["file", "line"]}
#: $defs declared after use, an enum behind $ref, anyOf, nested arrays/objects, bounds.
REFS = {
    "type": "object",
    "properties": {
        "color": {"$ref": "#/$defs/color"},
        "size": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
    "$defs": {
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "object", "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 4},
                                                 "v": {"const": 1}},
                "required": ["k", "v"], "additionalProperties": False},
    },
}


def spec_of(body: dict, face: str = "openai") -> ConstraintSpec | None:
    return constraint_from_body(body, face)


def api_error(body: dict, face: str = "openai") -> ApiError:
    """The error a face answers for ``body``: spec raises a domain error (no HTTP), mapped to a 400."""
    with pytest.raises(InvalidInputError) as e:
        constraint_from_body(body, face)
    api = ApiError.from_exception(e.value)
    assert api.status == 400 and api.type == "invalid_request_error"
    return api


# --------------------------------------------------------------------------- request fields

def test_llama_fields():
    assert spec_of({"grammar": 'root ::= "a"'}, "llama") == ConstraintSpec("grammar", 'root ::= "a"')
    assert spec_of({"json_schema": {"type": "object", "properties": {"b": {}, "a": {}}}}, "llama") == \
        ConstraintSpec("json_schema", '{"type":"object","properties":{"b":{},"a":{}}}')  # key order kept
    assert spec_of({"response_format": {"type": "json_object"}}, "llama") == ConstraintSpec("json_object", "")
    assert spec_of({"response_format": {"type": "json_object", "schema": {"type": "string"}}}, "llama") == \
        ConstraintSpec("json_schema", '{"type":"string"}')
    assert spec_of({"response_format": {"type": "text"}, "grammar": ""}, "llama") is None
    assert spec_of({"prompt": "x"}, "llama") is None
    # llama's face does not read vLLM's fields
    assert spec_of({"structured_outputs": {"regex": "a"}}, "llama") is None
    assert api_error({"grammar": 'root ::= "a"', "json_schema": {}}, "llama").message == LLAMA_BOTH
    assert api_error({"grammar": 5}, "llama").message == "Field 'grammar': type must be string, but is number"
    assert api_error({"json_schema": "x"}, "llama").message == \
        "Field 'json_schema': type must be object, but is string"


def test_openai_response_format():
    rf = {"type": "json_schema", "json_schema": {"name": "file_info", "schema": FILE_INFO, "strict": True}}
    assert spec_of({"response_format": rf}) == \
        ConstraintSpec("json_schema", json.dumps(FILE_INFO, separators=(",", ":")))
    assert spec_of({"response_format": {"type": "json_object"}}) == ConstraintSpec("json_object", "")
    assert spec_of({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}) == \
        ConstraintSpec("json_schema", "{}")
    assert api_error({"response_format": "json"}).message == \
        "Field 'response_format': type must be object, but is string"
    assert api_error({"response_format": {"type": "bogus"}}).message == \
        'Field \'response_format\': type must be one of "text", "json_object" or "json_schema", but got: bogus'
    assert "not supported yet" in api_error({"response_format": {"type": "structural_tag"}}).message


@pytest.mark.parametrize("members,expected", [
    ({"json": LOCATION}, ConstraintSpec("json_schema", json.dumps(LOCATION, separators=(",", ":")))),
    ({"json": json.dumps(LOCATION)}, ConstraintSpec("json_schema", json.dumps(LOCATION, separators=(",", ":")))),
    ({"regex": r"[0-9]+\.[0-9]+"}, ConstraintSpec("regex", r"[0-9]+\.[0-9]+")),
    ({"choice": ["yes", "no"]}, ConstraintSpec("choice", '["yes", "no"]')),
    ({"grammar": 'root ::= "x"'}, ConstraintSpec("grammar", 'root ::= "x"')),
    ({"json_object": True}, ConstraintSpec("json_object", "")),
    ({"json_object": False}, None),
    ({"regex": "a", "disable_any_whitespace": True}, ConstraintSpec("regex", "a")),
])
def test_structured_outputs_each_kind(members, expected):
    assert spec_of({"structured_outputs": members}) == expected


def test_vllm_messages_and_legacy_guided_fields():
    assert api_error({"structured_outputs": {"regex": "a+", "choice": ["a"]}}).message == VLLM_MULTIPLE
    assert api_error({"structured_outputs": {}}).message == VLLM_NONE
    assert api_error({"structured_outputs": {"disable_fallback": True}}).message == VLLM_NONE
    assert VLLM_MULTIPLE == "You can only use one kind of structured outputs constraint but multiple are specified"
    assert VLLM_NONE == "You must use one kind of structured outputs constraint but none are specified"
    assert "not supported yet" in api_error({"structured_outputs": {"structural_tag": "{}"}}).message
    assert spec_of({"guided_json": LOCATION}) == spec_of({"structured_outputs": {"json": LOCATION}})
    assert spec_of({"guided_regex": "[a-c]{3}"}) == ConstraintSpec("regex", "[a-c]{3}")
    assert spec_of({"guided_choice": ["red", "green"]}) == ConstraintSpec("choice", '["red", "green"]')
    assert spec_of({"guided_grammar": 'root ::= "z"'}) == ConstraintSpec("grammar", 'root ::= "z"')
    assert api_error({"guided_regex": "a", "guided_choice": ["a"]}).message == VLLM_MULTIPLE
    assert api_error({"guided_choice": []}).message == \
        "Field 'guided_choice': must be a non-empty array of strings"
    assert api_error({"structured_outputs": {"regex": ""}}).message == \
        "Field 'structured_outputs.regex': the regular expression is empty"
    assert api_error({"structured_outputs": {"json": "{bad"}}).message.startswith(
        "Field 'structured_outputs.json': not valid JSON")


def test_two_constraints_in_one_request_is_400():
    rf = {"type": "json_object"}
    assert api_error({"grammar": 'root ::= "a"', "response_format": rf}).message == \
        "only one output constraint may be given, but the request has both 'grammar' and 'response_format'"
    assert api_error({"response_format": rf, "structured_outputs": {"regex": "a"}}).message == \
        "only one output constraint may be given, but the request has both 'response_format' and " \
        "'structured_outputs'"
    assert "'structured_outputs' and 'guided_*'" in api_error(
        {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}).message
    assert api_error({"grammar": 'root ::= "a"', "json_schema": {}}).message == LLAMA_BOTH


def test_ollama_format():
    assert spec_of({"format": "json"}, "ollama") == ConstraintSpec("json_object", "")
    assert spec_of({"format": LOCATION}, "ollama") == spec_of({"json_schema": LOCATION}, "llama")
    assert spec_of({"format": ""}, "ollama") is None
    assert spec_of({"grammar": 'root ::= "a"'}, "ollama") is None
    assert api_error({"format": "xml"}, "ollama").message == \
        "Field 'format': must be \"json\" or a JSON schema object"
    with pytest.raises(ValueError):
        constraint_from_body({}, "grpc")
    with pytest.raises(ValueError):
        ConstraintSpec("yaml", "")


# --------------------------------------------------------------------------- the JSON-schema check

_TINY_INFO = xgr.TokenizerInfo([b"a", b"b"], vocab_size=2, stop_token_ids=[1])
_TINY_COMPILER = xgr.GrammarCompiler(_TINY_INFO, max_threads=1)


def raw_accepts(schema: dict, text: str) -> bool:
    """Does xgrammar itself (same options as the backend) accept ``text`` as a complete match?"""
    cg = _TINY_COMPILER.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=20,
                                            strict_mode=True)
    m = xgr.GrammarMatcher(cg)
    return m.accept_string(text) and m.is_completed()


class _TwoTokens:
    """The least a GrammarBackend needs from a tokenizer (ids 0 "a", 1 eos)."""

    eog_token_ids = frozenset({1})

    def __len__(self) -> int:
        return 2

    def token_bytes(self, i: int, special: bool = True) -> bytes:
        return [b"a", b"</s>"][i]


_TINY_BACKEND = GrammarBackend(_TwoTokens(), 2)


def test_backend_caches_die_with_the_backend():
    """Compiled grammars, the TokenizerInfo and the tokenizer go when the runner drops its backend
    (and the requests' matchers): no module-level cache keeps an unloaded model's vocabulary."""
    import gc
    import weakref

    tok = _TwoTokens()
    be = GrammarBackend(tok, 2)
    c = be.constraint(ConstraintSpec("regex", "a+"))
    assert c.accept_token(0) and be.cache_info()["size"] == 1
    refs = [weakref.ref(tok), weakref.ref(be)]
    del tok, be, c
    gc.collect()
    assert [r() for r in refs] == [None, None]


def accepts(spec: ConstraintSpec | dict, text: str) -> bool:
    """Does the backend (xgrammar plus kvserve's checks and fixes) accept ``text`` completely?"""
    if isinstance(spec, dict):
        spec = ConstraintSpec("json_schema", json.dumps(spec))
    try:
        return _TINY_BACKEND.constraint(spec, prefill=text).is_completed()
    except InvalidInputError as e:
        assert "does not match" in e.message
        return False


#: (keyword named in the 400, schema, an instance that breaks it but that xgrammar accepts)
IGNORED_BY_XGRAMMAR = [
    ("not", {"type": "integer", "not": {"const": 3}}, "3"),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1}'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    ("dependentSchemas", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a":1}'),
    ("contains", {"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"type": "integer"}},
     '["x"]'),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    ("format", {"type": "string", "format": "int32"}, '"x"'),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.3"),
    ("multipleOf", {"type": "integer", "multipleOf": 3, "exclusiveMaximum": 10}, "4"),
    ("pattern", {"type": "string", "pattern": "a^b"}, '"ab"'),
    ("minLength", {"type": "string", "pattern": "^[a-z]*$", "minLength": 2}, '"a"'),
    ("maxLength", {"type": "string", "format": "date", "maxLength": 5}, '"2024-01-02"'),
    ("minimum", {"enum": [1, 5], "minimum": 3}, "1"),
    ("enum", {"type": "integer", "enum": [1, "a"]}, '"a"'),
    ("type", {"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": -3}]}, '"x"'),
    ("minimum", {"minimum": 3}, "2"),
    ("required", {"type": "object", "required": ["a"]}, "{}"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("$ref", {"$defs": {"n": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}, '"x"'),
]


@pytest.mark.parametrize("keyword,schema,breaking", IGNORED_BY_XGRAMMAR,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(IGNORED_BY_XGRAMMAR)])
def test_keywords_xgrammar_ignores_are_refused(keyword, schema, breaking):
    # xgrammar (0.2.9) lets an instance through that breaks the keyword; if this assert fails,
    # a newer xgrammar enforces it and the keyword can move to the supported list
    assert raw_accepts(schema, breaking)
    if keyword != "format":  # jsonschema treats unknown formats as annotations
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(breaking), schema)
    with pytest.raises(SchemaError) as e:
        check_schema(schema)
    assert f"'{keyword}'" in str(e.value)
    # through the request field: 400 naming the field and the keyword
    err = api_error({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert err.message.startswith("Field 'response_format.json_schema.schema': ")
    assert f"'{keyword}'" in err.message


def test_refusal_names_the_location():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True,
                                                        "items": {"type": "string"}}}}
    with pytest.raises(SchemaError) as e:
        check_schema(schema)
    assert str(e.value) == ("keyword 'uniqueItems' at #/properties/tags is not supported: it is ignored by the "
                            "grammar backend")
    # behind a $ref declared later
    with pytest.raises(SchemaError, match=r"'not' at #/\$defs/x"):
        check_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"not": {}}}})
    with pytest.raises(SchemaError, match="does not resolve"):
        check_schema({"$ref": "#/$defs/missing"})
    with pytest.raises(SchemaError, match=r"'pattern' at #/properties/s is not a valid regular expression"):
        check_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-"}}})


@pytest.mark.parametrize("schema,good,bad", [
    (REFS, ['{"color":"red","size":null,"tags":[{"k":"ab","v":1}]}',
            '{"color": "blue", "size": 9, "tags": [{"k": "a", "v": 1}, {"k": "abcd", "v": 1}]}'],
     ['{"color":"pink","size":null,"tags":[{"k":"a","v":1}]}', '{"color":"red","size":10,"tags":[{"k":"a","v":1}]}',
      '{"color":"red","size":1,"tags":[]}', '{"color":"red","size":1,"tags":[{"k":"abcde","v":1}]}',
      '{"color":"red","size":1,"tags":[{"k":"a","v":2}]}', '{"color":"red","size":1}']),
    (FILE_INFO, ['{"file":"123456789012","lines":99999}', '{ "file" : "", "lines" : 0 }'],
     ['{"file":"1234567890123","lines":1}', '{"file":"a","lines":100000}', '{"file":"a","lines":-1}',
      '{"file":"a","lines":1,"x":1}']),
    ({"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "number", "minimum": 0.5}},
      "required": ["kind", "n"]}, ['{"kind":"a","n":0.5}'], ['{"kind":"b","n":1}', '{"kind":"a","n":0.4}']),
    ({"oneOf": [{"type": "object", "properties": {"t": {"const": "x"}}, "required": ["t"]},
                {"type": "object", "properties": {"t": {"const": "y"}, "n": {"type": "integer"}},
                 "required": ["t", "n"]}]}, ['{"t":"x"}', '{"t":"y","n":1}'], ['{"t":"z"}', '{"t":"y"}']),
    ({"type": "integer", "multipleOf": 3}, ["9", "0", "-3"], ["10", "4"]),
    ({"type": "string", "format": "email"}, ['"a@b.co"'], ['"nope"']),
])
def test_supported_keywords_are_enforced(schema, good, bad):
    check_schema(schema)
    fc = jsonschema.FormatChecker()
    for text in good:
        jsonschema.validate(json.loads(text), schema, format_checker=fc)
        assert accepts(schema, text), text
    for text in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), schema, format_checker=fc)
        assert not accepts(schema, text), text


def test_json_whitespace_is_bounded():
    assert accepts(FILE_INFO, "{" + " " * 20 + '"file":"a","lines":1}')
    assert not accepts(FILE_INFO, "{" + " " * 21 + '"file":"a","lines":1}')


def test_length_limited_strings_never_hold_raw_control_characters():
    # xgrammar's class for strings with maxLength lets a raw tab through (json.loads refuses it)
    text = '{"file":"a\tb","lines":1}'
    assert raw_accepts(FILE_INFO, text)
    with pytest.raises(ValueError):
        json.loads(text)
    assert not accepts(FILE_INFO, text)
    assert accepts(FILE_INFO, '{"file":"a b","lines":1}')


def test_json_numbers_have_at_most_16_digits():
    obj = ConstraintSpec("json_object", "")
    assert accepts(obj, '{"n": 1234567890123456, "x": 0.123456789012345, "e": 1e123456789012345}')
    assert not accepts(obj, '{"n": 12345678901234567}')
    assert not accepts(obj, '{"x": 0.1234567890123456}')
    # a bound the schema needs is kept; literal text is never touched
    big = {"type": "integer", "minimum": 10 ** 17}
    assert accepts(big, str(10 ** 17)) and not accepts(big, str(10 ** 17 - 1))
    const = {"const": "[0-9]*"}
    assert accepts(const, '"[0-9]*"') and not accepts(const, '"[0-9]{0,15}"')
    assert bound_numbers('a ::= "[0-9]*" [0-9]*') == 'a ::= "[0-9]*" [0-9]{0,15}'


@pytest.mark.parametrize("schema", [FILE_INFO, LOCATION, REFS, {"type": "string", "pattern": "^[a-z]+$"},
                                    {"type": "string", "format": "date-time"}])
def test_repaired_grammar_text_parses(schema):
    text = _TINY_BACKEND.grammar_text(ConstraintSpec("json_schema", json.dumps(schema)))
    assert bound_numbers(text) == text  # nothing left to repair
    assert str(xgr.Grammar.from_ebnf(text)) == text


@pytest.mark.parametrize("pattern,message", [
    ('[a-z]+"', "can produce"),
    (r"\\d", "can produce"),
    (r"\u0009", "can produce"),
    ("a^b", "'^' at position 1 is only supported at the start"),
    ("[a-", "is not a valid regular expression"),
])
def test_unsafe_or_invalid_patterns_are_refused(pattern, message):
    with pytest.raises(SchemaError) as e:
        check_schema({"type": "string", "pattern": pattern})
    assert message in str(e.value) and "'pattern' at the root" in str(e.value)


def test_pattern_with_negated_quote_class_is_enforced():
    schema = {"type": "string", "pattern": '^[^"\\\\]{2,3}$'}
    check_schema(schema)
    assert accepts(schema, '"ab"') and accepts(schema, '"a b"')
    assert not accepts(schema, '"a"') and not accepts(schema, '"abcd"') and not accepts(schema, '"a\\"b"')


def test_a_mask_is_never_empty():
    # no token of the two-token vocabulary can write "b": rather than an empty mask (which would
    # fail the engine step), only the end-of-generation token is allowed
    c = _TINY_BACKEND.constraint(ConstraintSpec("grammar", 'root ::= "b"'))
    assert c.mask().tolist() == [False, True]


def test_regex_dot_excludes_newline():
    rx = ConstraintSpec("regex", "a.c")
    assert accepts(rx, "abc") and not accepts(rx, "a\nc")
    assert re.fullmatch("a.c", "a\nc") is None
    with pytest.raises(InvalidInputError) as e:
        _TINY_BACKEND.constraint(ConstraintSpec("regex", "a$b"))
    assert e.value.message == "regex: '$' at position 1 is only supported at the end of the whole expression"


# --------------------------------------------------------------------------- GBNF

def test_gbnf_translation():
    seed = ('root ::= "{" space file-kv space "}"\n'
            'file-kv ::= "\\"file\\"" space ":" space "\\"" char{0,12} "\\""  # comment | here\n'
            'char ::= [^"\\\\] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})\n'
            "space ::= | \" \" | \"\\n\"{1,2} [ \\t]{0,20}\n")
    out = gbnf_to_ebnf(seed)
    assert out == seed.replace("space ::= |", 'space ::= "" |')
    assert gbnf_to_ebnf('a ::= ("x" | ) . "y"{,3}\nroot ::= a |') == \
        'a ::= ("x" | "" ) [\\0-\\U0010FFFF] "y"{0,3}\nroot ::= a | ""'
    assert gbnf_to_ebnf('root ::= "[.|(]" [.|(]') == 'root ::= "[.|(]" [.|(]'  # literals untouched
    xgr.Grammar.from_ebnf(out)
    with pytest.raises(GbnfError, match="token references"):
        gbnf_to_ebnf("root ::= <[1234]>")


def test_clean_error_strips_source_locations():
    with pytest.raises(RuntimeError) as e:
        xgr.Grammar.from_ebnf("root ::= foo")
    assert re.search(r"\.cc:\d+", str(e.value))
    assert clean_error(e.value) == 'EBNF parser error at line 1, column 10: Rule "foo" is not defined'


# --------------------------------------------------------------------------- backend on SmolLM2's vocabulary

@pytest.fixture(scope="module")
def smol_tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(smollm2_gguf)


@pytest.fixture(scope="module")
def backend(smol_tok) -> GrammarBackend:
    return GrammarBackend(smol_tok, smol_tok.n_vocab)


def test_compile_errors_are_400(backend):
    cases = [
        (ConstraintSpec("grammar", "root ::= foo"),
         'grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
        (ConstraintSpec("grammar", 'rot ::= "a"'),
         'grammar: EBNF parser error at line 1, column 1: The root rule with name "root" is not found'),
        (ConstraintSpec("grammar", "root ::= <|im_end|>"),
         ("grammar: token references such as <[1234]>, <|im_end|> or !<...> are not supported; write the text as "
          "a string literal")),
        (ConstraintSpec("regex", "(unclosed"), None),
        (ConstraintSpec("json_schema", '{"type":"strin"}'), 'json_schema: Unsupported type "strin"'),
        (ConstraintSpec("json_schema", '{"uniqueItems":true,"type":"array"}'),
         "json_schema: keyword 'uniqueItems' at the root is not supported: it is ignored by the grammar backend"),
    ]
    for spec, message in cases:
        with pytest.raises(InvalidInputError) as e:
            backend.constraint(spec)
        assert ApiError.from_exception(e.value).status == 400
        if message is not None:
            assert e.value.message == message
        assert e.value.message.startswith(spec.kind + ": ")
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", e.value.message)


def test_cache_counts_hits_and_misses(smol_tok):
    be = GrammarBackend(smol_tok, smol_tok.n_vocab, cache_size=2)
    a, b, c = (ConstraintSpec("regex", r) for r in ("a+", "b+", "c+"))
    be.constraint(a)
    be.constraint(a)
    assert (be.cache_hits, be.cache_misses) == (1, 1)
    be.constraint(b)
    be.constraint(c)  # evicts a (least recently used)
    be.constraint(a)
    held = be.compile(c).nbytes + be.compile(a).nbytes
    assert be.cache_info() == {"size": 2, "capacity": 2, "hits": 3, "misses": 4, "bytes": held,
                               "capacity_bytes": 256 * 1024 * 1024}
    assert be.compile(c) is be.compile(c)


def test_cache_is_bounded_by_bytes_and_huge_grammars_are_refused(smol_tok):
    """The compile cache holds at most cache_bytes (xgrammar's memory_size_bytes + text): a
    client sending many big distinct schemas cannot grow it past that; a grammar over
    max_grammar_chars is a 400 before xgrammar spends minutes compiling it."""
    def enum(n: int, tag: str) -> ConstraintSpec:
        return ConstraintSpec("json_schema", json.dumps({"enum": [f"{tag} value {i}" for i in range(n)]}))

    probe = GrammarBackend(smol_tok, smol_tok.n_vocab)
    one = probe.compile(enum(300, "a")).nbytes
    assert one > 10_000
    be = GrammarBackend(smol_tok, smol_tok.n_vocab, cache_bytes=int(2.5 * one))
    for tag in "abcd":
        be.compile(enum(300, tag))
        info = be.cache_info()
        assert info["bytes"] <= 2.5 * one
    assert info["size"] == 2  # c and d: a and b were dropped for bytes, not for count
    assert be.compile(enum(300, "d")) is be.compile(enum(300, "d"))
    small = GrammarBackend(smol_tok, smol_tok.n_vocab, cache_bytes=one // 2)
    e = small.compile(enum(300, "a"))  # larger than the whole budget: used, not kept
    assert small.cache_info()["size"] == 0 and small.cache_info()["bytes"] == 0
    assert "a value 299" in e.text

    tight = GrammarBackend(smol_tok, smol_tok.n_vocab, max_grammar_chars=2000)
    with pytest.raises(InvalidInputError) as err:
        tight.compile(enum(300, "a"))
    n = len(probe.compile(enum(300, "a")).text)
    assert str(err.value) == f"json_schema: the grammar is too large ({n} characters of EBNF; at most 2000)"
    with pytest.raises(InvalidInputError) as err:
        tight.compile(ConstraintSpec("grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(400))))
    assert str(err.value).startswith("grammar: the grammar is too large (")


def test_grammar_text(backend):
    g = 'root ::= ("yes" | "no") "\\n"'
    assert backend.grammar_text(ConstraintSpec("grammar", g)) == g  # GBNF as given
    assert backend.grammar_text(ConstraintSpec("regex", r"[0-9]+\.[0-9]+")) == \
        str(xgr.Grammar.from_regex(r"[0-9]+\.[0-9]+"))
    text = backend.grammar_text(ConstraintSpec("json_schema", json.dumps(FILE_INFO)))
    raw = str(xgr.Grammar.from_json_schema(json.dumps(FILE_INFO), any_whitespace=True, max_whitespace_cnt=20,
                                           strict_mode=True))
    # xgrammar's text, repaired: no raw control characters in length-limited strings, bounded digits
    assert r'root_prop_0_characters ::= (([^\"\\\r\n]))' in raw and "[0-9]*" in raw
    assert r'root_prop_0_characters ::= (([^\0-\x1f\"\\]))' in text and "[0-9]*" not in text
    assert 'root_prop_0 ::= (("\\"" root_prop_0_characters{0, 12} "\\""))' in text
    assert 'file_kv' not in text and 'root ::= (("{" whitespace_13{0, 20} "\\"file\\""' in text
    assert backend.grammar_text(ConstraintSpec("choice", '["a\\"b", "c"]')) == 'root ::= (("a\\"b") | ("c"))\n'


def _ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


def test_mask_control_tokens_and_eog(backend, smol_tok):
    tok = smol_tok
    eog = set(tok.eog_token_ids)
    control = {i for i in range(tok.n_vocab) if tok.is_control(i)} - eog
    assert 1 in control and tok.token_text(1) == "<|im_start|>" and eog == {0, 2, 4}
    # free text inside a JSON string: almost everything is allowed, never a control token, no EOG
    c = backend.constraint(ConstraintSpec("json_object", ""), prefill='{"a": "')
    m = c.mask()
    assert m.dtype == torch.bool and m.shape == (tok.n_vocab,)
    allowed = _ids(m)
    assert len(allowed) > 40000
    assert not allowed & control and not allowed & eog
    # a regex that may end or go on: EOG allowed together with digits
    c = backend.constraint(ConstraintSpec("regex", r"[0-9]+\.[0-9]+"))
    assert not _ids(c.mask()) & eog
    for t in tok.encode("3.1"):
        assert c.accept_token(t)
    allowed = _ids(c.mask())
    assert eog <= allowed and tok.encode("4")[0] in allowed and not allowed & control
    # a complete grammar that cannot go on: only EOG
    c = backend.constraint(ConstraintSpec("grammar", 'root ::= ("yes" | "no") "\\n"'))
    assert {tok.token_text(i) for i in _ids(c.mask())} == {"n", "no", "y", "ye", "yes"}
    assert [c.accept_token(t) for t in tok.encode("yes\n")] == [True, True]
    assert _ids(c.mask()) == eog
    assert not c.accept_token(tok.encode("x")[0])  # refused, state unchanged
    assert c.is_completed() and not c.is_terminated()
    assert c.accept_token(2) and c.is_terminated() and _ids(c.mask()) == eog


def test_mask_has_the_logits_width(smol_tok):
    be = GrammarBackend(smol_tok, smol_tok.n_vocab + 64)  # a model whose output rows are padded
    c = be.constraint(ConstraintSpec("json_object", ""), prefill='{"a": "')
    m = c.mask()
    assert m.shape == (smol_tok.n_vocab + 64,) and not m[smol_tok.n_vocab:].any()
    assert c.is_completed() is False


def test_prefill(backend):
    c = backend.constraint(ConstraintSpec("json_schema", json.dumps(FILE_INFO)), prefill='{"file": "ab')
    assert not c.is_completed()
    with pytest.raises(InvalidInputError) as e:
        backend.constraint(ConstraintSpec("json_schema", json.dumps(FILE_INFO)), prefill="hello")
    assert ApiError.from_exception(e.value).status == 400 and "does not match" in e.value.message


# --------------------------------------------------------------------------- the engine (tiny random model)

class _Gate:
    """A constraint-protocol object with scripted answers (the hook as the engine sees it)."""

    def __init__(self, n_vocab: int, allowed: list[int], refuse_after: int = 99, terminate_after: int = 99):
        self.m = torch.zeros(n_vocab, dtype=torch.bool)
        self.m[allowed] = True
        self.accepted: list[int] = []
        self.refuse_after, self.terminate_after = refuse_after, terminate_after

    def mask(self):
        return self.m

    def accept_token(self, token_id: int) -> bool:
        if len(self.accepted) >= self.refuse_after:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.terminate_after


def _run(core: EngineCore, reqs: list[Request]) -> dict[str, tuple[str, str, list[int]]]:
    out = {r.request_id: ["", "", []] for r in reqs}
    for r in reqs:
        core.add_request(r)
    pending = set(out)
    while pending:
        for o in core.step():
            e = out[o.request_id]
            e[0] += o.text
            e[2] += o.new_token_ids
            if o.finished:
                e[1] = o.stop_type
                pending.discard(o.request_id)
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_core(tiny_gguf) -> EngineCore:
    return EngineCore(load_files(tiny_gguf), EngineConfig(n_ctx=512, dtype="float32", n_parallel=8, kv_unified=True))


def test_engine_hook_on_tiny_model(tiny_core):
    core, tok = tiny_core, tiny_core.tokenizer
    nv = core.model_config.n_vocab
    be = GrammarBackend(tok, nv)
    prompt = tok.encode("the cat", add_special=True)
    g = ConstraintSpec("grammar", 'root ::= "ab" [0-9]{2} "."')
    bias = {i: float("-inf") for i in range(3, nv)}  # bans every text token: the grammar wins over logit_bias
    sampled = SamplingParams(n_predict=30, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    reqs = [
        Request("greedy", prompt, SamplingParams(n_predict=30, temperature=0.0), grammar=be.constraint(g)),
        Request("sampled", prompt, sampled, grammar=be.constraint(g)),
        Request("ignore_eos", prompt, SamplingParams(n_predict=30, temperature=0.0, ignore_eos=True),
                grammar=be.constraint(g)),
        Request("min_tokens", prompt, SamplingParams(n_predict=30, temperature=0.0, min_tokens=20),
                grammar=be.constraint(g)),
        Request("bias", prompt, SamplingParams(n_predict=30, temperature=0.0, logit_bias=bias),
                grammar=be.constraint(g)),
        Request("refused", prompt, SamplingParams(n_predict=30, temperature=0.0),
                grammar=_Gate(nv, [tok.encode("x")[0]], refuse_after=2)),
        Request("terminated", prompt, SamplingParams(n_predict=30, temperature=0.0),
                grammar=_Gate(nv, [tok.encode("y")[0]], terminate_after=3)),
        Request("free", prompt, SamplingParams(n_predict=5, temperature=0.0)),
    ]
    res = _run(core, reqs)
    for rid in ("greedy", "sampled", "ignore_eos", "min_tokens", "bias"):
        text, stop, toks = res[rid]
        assert re.fullmatch(r"ab[0-9]{2}\.", text), (rid, text)
        assert stop == "eos" and toks[-1] in tok.eog_token_ids, rid
    assert res["refused"] == ("xx", "eos", [tok.encode("x")[0]] * 3)  # the refused token's text is not emitted
    assert res["terminated"] == ("yy", "eos", [tok.encode("y")[0]] * 3)
    free = _run(core, [Request("free2", prompt, SamplingParams(n_predict=5, temperature=0.0))])["free2"]
    assert res["free"] == free and free[1] == "limit"  # the unconstrained row in the same batch is unaffected


# --------------------------------------------------------------------------- the engine (SmolLM2)

@pytest.fixture(scope="module")
def smol_core(smollm2_gguf) -> EngineCore:
    return EngineCore(load_files(smollm2_gguf), EngineConfig(n_ctx=4096, n_parallel=64, kv_unified=True))


def test_seed12_yes_no_grammar_ends_with_eos(smol_core):
    core, tok = smol_core, smol_core.tokenizer
    be = GrammarBackend(tok, core.model_config.n_vocab)
    req = Request("yn", tok.encode("Answer:", add_special=True), SamplingParams(n_predict=20, temperature=0.0),
                  grammar=be.constraint(ConstraintSpec("grammar", 'root ::= ("yes" | "no") "\\n"')))
    text, stop, toks = _run(core, [req])["yn"]
    assert (text, stop) == ("no\n", "eos")
    assert toks[-1] in tok.eog_token_ids and len(toks) < 20
    assert tok.decode(toks[:-1]) == "no\n"


def test_seed12_file_info_50_sampled_runs(smol_core):
    core, tok = smol_core, smol_core.tokenizer
    be = GrammarBackend(tok, core.model_config.n_vocab)
    spec = constraint_from_body({"response_format": {"type": "json_schema", "json_schema": {
        "name": "file_info", "schema": FILE_INFO}}}, "openai")
    prompt = tok.encode("Give a file name and line count.", add_special=True)
    reqs = [Request(f"f{i}", prompt, SamplingParams(n_predict=256, temperature=1.0, seed=i),
                    grammar=be.constraint(spec)) for i in range(50)]
    res = _run(core, reqs)
    texts = set()
    for text, stop, _ in res.values():
        assert stop == "eos", text
        obj = json.loads(text)
        jsonschema.validate(obj, FILE_INFO)
        assert len(obj["file"]) <= 12 and 0 <= obj["lines"] <= 99999
        texts.add(text)
    assert len(texts) > 25  # different seeds, different outputs
    assert (be.cache_hits, be.cache_misses) == (49, 1)


def test_every_kind_in_one_batch(smol_core):
    core, tok = smol_core, smol_core.tokenizer
    be = GrammarBackend(tok, core.model_config.n_vocab)
    cases = {
        "json": ({"structured_outputs": {"json": LOCATION}}, "Extract the file and line from: NPE at Main.java:42",
                 lambda s: jsonschema.validate(json.loads(s), LOCATION) is None),
        # an unbounded regex: a 135M model may write digits until n_predict; the text still matches
        "regex": ({"structured_outputs": {"regex": r"[0-9]+\.[0-9]+"}}, "Give the Java version as major.minor.",
                  lambda s: re.fullmatch(r"[0-9]+\.[0-9]+", s) is not None),
        "choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, "Is this diff safe to apply? Answer yes or no.",
                   lambda s: s in ("yes", "no")),
        "grammar": ({"guided_grammar": 'root ::= "v" [0-9] "." [0-9] "\\n"'}, "Version?",
                    lambda s: re.fullmatch(r"v[0-9]\.[0-9]\n", s) is not None),
        "json_object": ({"response_format": {"type": "json_object"}}, "A JSON object, please.",
                        lambda s: isinstance(json.loads(s), dict)),
        "refs": ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": REFS}}},
                 "Describe a shirt.", lambda s: jsonschema.validate(json.loads(s), REFS) is None),
    }
    reqs = []
    for name, (body, prompt, _) in cases.items():
        spec = constraint_from_body(body, "openai")
        ids = tok.encode(prompt, add_special=True)
        n = 24 if name == "regex" else 160
        reqs.append(Request(f"{name}-greedy", ids, SamplingParams(n_predict=n, temperature=0.0),
                            grammar=be.constraint(spec)))
        for seed in range(2):
            reqs.append(Request(f"{name}-{seed}", ids, SamplingParams(n_predict=n, temperature=1.0, seed=seed),
                                grammar=be.constraint(spec)))
    res = _run(core, reqs)
    for rid, (text, stop, toks) in res.items():
        name = rid.rsplit("-", 1)[0]
        n = 24 if name == "regex" else 160
        # every token, the end-of-generation one included, is one the request's own grammar
        # allows, checked on a fresh matcher (no row of the batch got another row's mask)
        fresh = be.constraint(constraint_from_body(cases[name][0], "openai"))
        assert all(fresh.accept_token(t) for t in toks), (rid, text)
        if stop == "limit":
            # what the server guarantees, not what the model writes: an unbounded grammar (a
            # JSON string of any length, an object with ever more keys, a run of digits) may
            # be cut at n_predict, and a sampled 135M model is on some CPUs (json-0 on an AMD
            # EPYC with AVX512-BF16 writes one "file" string for 160 tokens); the cut text is
            # a prefix the grammar accepts, every token accounted for. "choice" and "grammar"
            # allow no text longer than a few tokens: they must end with the end-of-generation.
            assert name not in ("choice", "grammar"), (rid, text)
            assert len(toks) == n and not fresh.is_terminated(), (rid, text)
            assert text == tok.decode(toks), (rid, text)
            continue
        assert stop == "eos", (rid, text)
        assert toks[-1] in tok.eog_token_ids and len(toks) <= n and fresh.is_terminated(), (rid, text)
        assert text == tok.decode(toks[:-1]), (rid, text)
        assert cases[name][2](text), (rid, text)


@pytest.mark.parametrize("schema,msg", [
    ({"anyOf": []}, "'anyOf' at the root must be a non-empty array"),
    ({"type": "string", "minLength": -1}, "'minLength' at the root must be a non-negative integer"),
    ({"type": "array", "maxItems": 2.5}, "'maxItems' at the root must be a non-negative integer"),
])
def test_unsatisfiable_or_bad_bounds_are_400(schema, msg):
    from kvserve.structured.spec import constraint_from_body

    with pytest.raises(InvalidInputError) as e:
        constraint_from_body({"json_schema": schema}, "llama")
    assert ApiError.from_exception(e.value).status == 400 and msg in str(e.value)


def test_constrained_output_check(smol_core):
    """tests/constrained.py, which API tests use on unbounded constraints, can fail."""
    from constrained import accepts_prefix, check_constrained

    tok = smol_core.tokenizer
    body = {"structured_outputs": {"json": LOCATION}}
    valid = lambda s: jsonschema.validate(json.loads(s), LOCATION) is None  # noqa: E731
    assert accepts_prefix(tok, body, "openai", '{"file": "Main.ja') and accepts_prefix(tok, body, "openai", "")
    assert not accepts_prefix(tok, body, "openai", "Main.java") and not accepts_prefix(tok, body, "openai", '{"x"')
    check_constrained(tok, body, "openai", '{"file": "Main.ja', "length", 120, 120, valid)
    check_constrained(tok, body, "openai", '{"file": "Main.java", "line": 42}', "stop", 14, 120, valid)
    for text, finish, n in [('{"file": "Main.ja', "length", 119),  # cut before the limit
                            ('{"file": "Main.ja', "stop", 9),  # ended, but incomplete
                            ("Main.java", "length", 120),  # not what the grammar allows
                            ('{"file": "Main.java", "line": 42}', "stop", 121)]:  # over the limit
        with pytest.raises((AssertionError, ValueError)):
            check_constrained(tok, body, "openai", text, finish, n, 120, valid)


def test_tuple_items_array_form_as_llama_cpp():
    """``"items": [A, B]`` (draft 4's tuple form) is exactly those items, as llama.cpp reads it."""
    from kvserve.structured.spec import schema_spec, tuple_items

    spec = schema_spec({"items": [{"type": "integer"}, {"type": "string"}]}, "response_format.schema")
    assert json.loads(spec.value) == {"items": False, "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                      "minItems": 2}
    assert accepts(spec, '[-3000, "a"]')
    assert not accepts(spec, "[-3000]") and not accepts(spec, '[-3000, "a", 1]')
    data = {"enum": [{"items": [1]}]}
    assert tuple_items(data) == data  # enum values are data


def test_ambiguous_grammar_is_refused_quickly_and_remembered(smol_tok):
    """'(a*)*' repeated makes xgrammar's next-token mask cost seconds to minutes (cubic in the
    repeats), which would stall every request batched with it: a 400 within the probe's budget,
    and the same spec again is refused at once; an ordinary regex still compiles."""
    import time

    be = GrammarBackend(smol_tok, smol_tok.n_vocab, max_mask_s=0.05)
    assert be.constraint(ConstraintSpec("regex", "[a-z]+ [0-9]{3}")).is_completed() is False
    spec = ConstraintSpec("regex", "(a*)*" * 300)  # ~0.3 s per mask here; 2,000 repeats: ~70 s
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(InvalidInputError) as e:
            be.constraint(spec)
        assert time.monotonic() - t0 < 5
        assert e.value.message == ("regex: the grammar is too expensive to enforce (one next-token mask takes more "
                                   "than 0.05 s; an ambiguous expression such as nested repetition '(a*)*' usually "
                                   "causes it)")
        assert ApiError.from_exception(e.value).status == 400
    assert be.cache_info()["size"] == 1


def _nested_arrays(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth - 1):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize("face,body,field", [
    ("llama", lambda s: {"json_schema": s}, "json_schema"),
    ("openai", lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}},
     "response_format.json_schema.schema"),
    ("openai", lambda s: {"structured_outputs": {"json": s}}, "structured_outputs.json"),
    ("ollama", lambda s: {"format": s}, "format"),
])
def test_schema_depth_and_size_are_capped_early(face, body, field):
    """A 600-deep schema was a RecursionError (500) in the walk, a 400-deep one cost 5 s: both are a
    400 naming the cap at once; 128 levels (the cap) still pass the check."""
    import time

    from kvserve.structured.schema import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES

    assert (MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES) == (128, 100_000)
    assert spec_of(body(_nested_arrays(128)), face).kind == "json_schema"
    for depth in (129, 400, 600, 5000):
        t0 = time.monotonic()
        err = api_error(body(_nested_arrays(depth)), face)
        assert time.monotonic() - t0 < 1
        assert err.message == (f"Field '{field}': the schema is nested too deeply (more than 128 levels of objects "
                               "and arrays)")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "array", "items": {"type": "integer"}}
                                             for i in range(50_000)}}
    assert api_error(body(wide), face).message.endswith("the schema is too large (more than 100000 objects and "
                                                       "arrays)")


def test_runaway_probes_are_bounded(smol_tok):
    """Each refused probe keeps a core until its mask is done: while MAX_RUNAWAY_PROBES (2) run, a new grammar is
    a 503 (cached ones still serve); once they end, grammars compile again."""
    import time

    from kvserve.errors import UnavailableError
    from kvserve.structured import backend as backend_mod

    def settle():
        t0 = time.monotonic()
        while backend_mod._runaway[0] and time.monotonic() - t0 < 60:  # earlier tests' refused probes
            time.sleep(0.05)
        assert backend_mod._runaway[0] == 0

    settle()
    be = GrammarBackend(smol_tok, smol_tok.n_vocab, max_mask_s=0.02)
    ok = ConstraintSpec("regex", "[a-z]+")
    be.constraint(ok)
    for n in (500, 501):  # ~1 s per mask here
        with pytest.raises(InvalidInputError):
            be.constraint(ConstraintSpec("regex", "(a*)*" * n))
    assert backend_mod._runaway[0] == 2
    with pytest.raises(UnavailableError) as e:
        be.constraint(ConstraintSpec("regex", "[0-9]+"))
    assert e.value.message == ("regex: 2 grammars too expensive to enforce are still being measured; try again "
                               "later")
    assert ApiError.from_exception(e.value).status == 503
    assert be.constraint(ok).is_completed() is False  # a cached grammar is not probed again
    settle()
    slow = GrammarBackend(smol_tok, smol_tok.n_vocab)  # the default 1 s budget: a plain regex is fine
    assert slow.constraint(ConstraintSpec("regex", "[0-9]+")).is_completed() is False
