"""Structured outputs on llama-server's native ``/completion`` (seed 000 Example 12): ``grammar``
(GBNF), ``json_schema`` and ``response_format``, generation_settings.grammar, several prompts,
streaming, and the 400s for constraints the backend cannot enforce."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from constrained import check_constrained  # tests/ is on sys.path

YES_NO = 'root ::= ("yes" | "no") "\\n"'
FILE_INFO = {
    "type": "object",
    "properties": {"file": {"type": "string", "maxLength": 12},
                   "lines": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["file", "lines"], "additionalProperties": False,
}


def _completion(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url("/completion"), json=body, timeout=120)


def _ok(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


def test_seed12_yes_no_grammar(smollm2_server):
    res = _ok(_completion(smollm2_server, {"prompt": "Answer:", "n_predict": 20, "temperature": 0,
                                           "grammar": YES_NO, "return_tokens": True}))
    # "n" "o" "\n" then the only token left, end-of-generation (4 tokens, as in the seed)
    assert (res["content"], res["stop_type"], res["tokens_predicted"]) == ("no\n", "eos", 4)
    assert res["tokens"][:3] == [94, 95, 198]
    assert res["generation_settings"]["grammar"] == YES_NO


def test_json_schema_field(smollm2_server):
    res = _ok(_completion(smollm2_server, {"prompt": "Give a file name and line count.", "n_predict": 300,
                                           "temperature": 0, "json_schema": FILE_INFO}))
    assert res["stop_type"] == "eos"
    jsonschema.validate(json.loads(res["content"]), FILE_INFO)
    grammar = res["generation_settings"]["grammar"]
    assert 'root_prop_0 ::= (("\\"" root_prop_0_characters{0, 12} "\\""))' in grammar
    assert grammar.startswith("whitespace ::= ")


def test_response_format_and_several_prompts(smollm2_server, smollm2_tokenizer):
    res = _ok(_completion(smollm2_server, {"prompt": ["Answer:", "Is it safe? Reply:"], "n_predict": 20,
                                           "temperature": 1.0, "seed": 3, "grammar": YES_NO}))
    assert [r["index"] for r in res] == [0, 1]
    for r in res:  # each prompt has its own matcher
        assert r["content"] in ("yes\n", "no\n") and r["stop_type"] == "eos"
    fmt = {"response_format": {"type": "json_object"}}
    res = _ok(_completion(smollm2_server, {"prompt": "A JSON object:", "n_predict": 200, "temperature": 0, **fmt}))
    # any object is allowed, so the model may still be writing one at n_predict on some CPUs
    check_constrained(smollm2_tokenizer, fmt, "llama", res["content"], res["stop_type"], res["tokens_predicted"],
                      200, lambda s: isinstance(json.loads(s), dict))


def test_streamed_grammar_output_is_the_same(smollm2_server):
    body = {"prompt": "Give a file name and line count.", "n_predict": 300, "temperature": 0,
            "json_schema": FILE_INFO}
    whole = _ok(_completion(smollm2_server, body))["content"]
    text, last = "", None
    with httpx.stream("POST", smollm2_server.url("/completion"), json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                text += last["content"]
    assert text == whole and last["stop"] is True and last["stop_type"] == "eos"


@pytest.mark.parametrize("extra,message", [
    ({"grammar": "root ::= foo"}, 'grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"grammar": YES_NO, "json_schema": FILE_INFO}, 'Either "json_schema" or "grammar" can be specified, but not both'),
    ({"grammar": YES_NO, "response_format": {"type": "json_object"}},
     "only one output constraint may be given, but the request has both 'grammar' and 'response_format'"),
    ({"json_schema": {"type": "string", "pattern": "[a-"}},
     ("Field 'json_schema': 'pattern' at the root is not a valid regular expression ('[a-'): Regex parsing error at "
      "position 4: Unclosed '['")),
    ({"json_schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
     "Field 'json_schema': keyword 'uniqueItems' at the root is not supported: it is ignored by the grammar backend"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-ish"}}}}}},
     "Field 'response_format.json_schema.schema': 'format' 'date-ish' at #/properties/when is not supported"),
])
def test_constraints_the_backend_cannot_enforce_are_400(smollm2_server, extra, message):
    r = _completion(smollm2_server, {"prompt": "x", "n_predict": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(message)
    assert "Traceback" not in smollm2_server.log()
