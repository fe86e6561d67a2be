"""Forced tool-call grammars (kvserve.chat.tool_grammar), checked with real xgrammar matchers."""

from __future__ import annotations

import pytest

from kvserve.chat.tool_parsers import get_tool_parser
from kvserve.chat.tool_grammar import (
    TOOL_GRAMMAR_FORMATS,
    tool_call_grammar,
    tool_call_prefix,
    tool_functions,
)

xgr = pytest.importorskip("xgrammar")

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string", "enum": ["pom.xml", "src/Main.java"]}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "list_dir",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string"}, "depth": {"type": "integer"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters
]

# toy vocabulary: printable ASCII, newline, a few multi-char and marker tokens, eos last
VOCAB = ([chr(i) for i in range(32, 127)] + ["\n", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", '{"', '":',
                                             "path", "Hello", "</s>"])
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]))


def matcher(compiler, grammar: str):
    return xgr.GrammarMatcher(compiler.compile_grammar(grammar))


def complete(compiler, grammar: str, text: str) -> bool:
    """The grammar accepts exactly ``text`` (then only the end of generation)."""
    m = matcher(compiler, grammar)
    return m.accept_string(text) and m.accept_token(EOS) and m.is_terminated()


def allowed_tokens(m) -> set[str]:
    bm = xgr.allocate_token_bitmask(1, len(VOCAB))
    m.fill_next_token_bitmask(bm)
    return {VOCAB[i] for i in range(len(VOCAB)) if (int(bm[0, i // 32]) >> (i % 32)) & 1}


H_READ = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/Main.java"}}\n</tool_call>'
H_LIST = '<tool_call>\n{"name": "list_dir", "arguments": {"path": "src", "depth": 2}}\n</tool_call>'
H_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'

VALID = {
    "hermes": [H_READ, H_LIST, H_NOW, '<tool_call>\n{"name": "list_dir", "arguments": {"path": "a b"}}\n</tool_call>'],
    "llama3_json": ['{"name": "read_file", "parameters": {"path": "pom.xml"}}', '{"name": "now", "parameters": {}}'],
    "mistral": ['[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "pom.xml"}}]',
                '[TOOL_CALLS][{"name": "now", "arguments": {}}]'],
    "pythonic": ['[read_file(path="pom.xml")]', '[list_dir(path="src", depth=-3)]', "[now()]",
                 '[list_dir(path="a\\"b\\u00e9")]'],
    "granite": ['[{"name": "read_file", "arguments": {"path": "pom.xml"}}]', '[{"name": "now", "arguments": {}}]'],
}
VALID["llama4_json"], VALID["llama4_pythonic"] = VALID["llama3_json"], VALID["pythonic"]


def xml_calls(fmt: str) -> dict[str, str]:
    """read_file(path="pom.xml"), list_dir(path="a b", depth=2) and now() in an XML format."""
    if fmt in ("qwen3_coder", "qwen3_xml", "seed_oss"):
        o, c = ("<seed:tool_call>", "</seed:tool_call>") if fmt == "seed_oss" else ("<tool_call>", "</tool_call>")
        return {"read": f"{o}\n<function=read_file>\n<parameter=path>pom.xml</parameter>\n</function>\n{c}",
                "list": f"{o}\n<function=list_dir>\n<parameter=path>a b</parameter>\n<parameter=depth>2</parameter>"
                        f"\n</function>\n{c}",
                "now": f"{o}\n<function=now>\n\n</function>\n{c}",
                "bad_enum": f"{o}\n<function=read_file>\n<parameter=path>other</parameter>\n</function>\n{c}"}
    if fmt in ("glm45", "glm47"):
        return {"read": "<tool_call>read_file\n<arg_key>path</arg_key><arg_value>pom.xml</arg_value>\n</tool_call>",
                "list": "<tool_call>list_dir\n<arg_key>path</arg_key><arg_value>a b</arg_value>\n"
                        "<arg_key>depth</arg_key><arg_value>2</arg_value>\n</tool_call>",
                "now": "<tool_call>now\n\n</tool_call>",
                "bad_enum": "<tool_call>read_file\n<arg_key>path</arg_key><arg_value>x</arg_value>\n</tool_call>"}
    return {"read": '<minimax:tool_call>\n<invoke name="read_file">\n<parameter name="path">pom.xml</parameter>\n'
                    "</invoke>\n</minimax:tool_call>",
            "list": '<minimax:tool_call>\n<invoke name="list_dir">\n<parameter name="path">a b</parameter>\n'
                    '<parameter name="depth">2</parameter>\n</invoke>\n</minimax:tool_call>',
            "now": '<minimax:tool_call>\n<invoke name="now">\n\n</invoke>\n</minimax:tool_call>',
            "bad_enum": '<minimax:tool_call>\n<invoke name="read_file">\n<parameter name="path">x</parameter>\n'
                        "</invoke>\n</minimax:tool_call>"}


XML_FORMATS = ("qwen3_coder", "qwen3_xml", "seed_oss", "glm45", "glm47", "minimax_m2")
for _f in XML_FORMATS:
    _x = xml_calls(_f)
    VALID[_f] = [_x["read"], _x["list"], _x["now"]]
VALID["granite4"], VALID["mimo"] = VALID["hermes"], VALID["qwen3_coder"]
VALID["phi4_mini_json"] = ["functools" + t for t in VALID["granite"]]
VALID["longcat"] = [t.replace("tool_call>", "longcat_tool_call>") for t in VALID["hermes"]]
PARALLEL = {
    "hermes": H_READ + "\n" + H_NOW,
    "llama3_json": '{"name": "read_file", "parameters": {"path": "pom.xml"}}; {"name": "now", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "pom.xml"}}, '
               '{"name": "now", "arguments": {}}]',
    "pythonic": '[read_file(path="pom.xml"), now()]',
    "granite": '[{"name": "read_file", "arguments": {"path": "pom.xml"}}, {"name": "now", "arguments": {}}]',
}
PARALLEL["llama4_json"], PARALLEL["llama4_pythonic"] = PARALLEL["llama3_json"], PARALLEL["pythonic"]
for _f in XML_FORMATS:
    PARALLEL[_f] = xml_calls(_f)["read"] + "\n" + xml_calls(_f)["now"]
PARALLEL["granite4"], PARALLEL["mimo"] = PARALLEL["hermes"], PARALLEL["qwen3_coder"]
PARALLEL["phi4_mini_json"] = "functools" + PARALLEL["granite"]
PARALLEL["longcat"] = PARALLEL["hermes"].replace("tool_call>", "longcat_tool_call>")
INVALID = {
    "hermes": [
        "Hello " + H_READ,  # free text first
        H_READ.replace("read_file", "write_file"),  # unknown tool
        H_READ.replace("src/Main.java", "secret.txt"),  # not in the enum
        H_LIST.replace(', "depth": 2', ""),  # fine: optional (checked below as valid)
        H_NOW.replace("{}", '{"x": 1}'),  # no parameters means exactly {}
        H_READ.replace('{"path": "src/Main.java"}', '{"path": "pom.xml", "mode": "r"}'),  # extra property
        H_READ.replace('{"path"', '{ "path"'),  # whitespace is fixed
        H_LIST.replace('"depth": 2', '"depth": 2.5'),  # integer
        '<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>',  # required property missing
        H_READ + "\n" + H_NOW,  # a second call without parallel
        "",  # no call at all
    ],
    "llama3_json": ['{"name": "read_file", "arguments": {"path": "pom.xml"}}', 'x{"name": "now", "parameters": {}}'],
    "mistral": ['[TOOL_CALLS]{"name": "now", "arguments": {}}', '[{"name": "now", "arguments": {}}]'],
    "pythonic": ['[read_file(path="other")]', "[read_file()]", "[now(x=1)]", '[read_file(path="pom.xml"), now()]',
                 '[list_dir(depth=1, path="a")]', "read_file(path='pom.xml')"],
    "granite": ['[TOOL_CALLS][{"name": "now", "arguments": {}}]', '{"name": "now", "arguments": {}}'],
}
INVALID["llama4_json"], INVALID["llama4_pythonic"] = INVALID["llama3_json"], INVALID["pythonic"]
for _f in XML_FORMATS:
    _x = xml_calls(_f)
    INVALID[_f] = [_x["bad_enum"], "Hello " + _x["read"], _x["read"].replace("read_file", "write_file"),
                   _x["read"] + "\n" + _x["now"], ""]
INVALID["granite4"], INVALID["mimo"] = INVALID["hermes"], INVALID["qwen3_coder"]
INVALID["phi4_mini_json"] = INVALID["granite"] + VALID["granite"]
INVALID["longcat"] = VALID["hermes"] + ["Hello " + VALID["longcat"][0], ""]


@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_valid_calls_are_accepted_and_parse(compiler, fmt):
    g = tool_call_grammar(fmt, TOOLS)
    xgr.Grammar.from_ebnf(g)  # plain EBNF text that round-trips
    parser = get_tool_parser(fmt)
    for text in VALID[fmt]:
        assert complete(compiler, g, text), text
        got = parser.extract(text)  # what the grammar forces, the parser reads
        assert len(got.calls) == 1 and got.content is None, text


@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_invalid_calls_are_rejected(compiler, fmt):
    g = tool_call_grammar(fmt, TOOLS)
    for text in INVALID[fmt]:
        if text == H_LIST.replace(', "depth": 2', ""):
            assert complete(compiler, g, text)
            continue
        assert not complete(compiler, g, text), text


@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_parallel_calls(compiler, fmt):
    text = PARALLEL[fmt]
    assert not complete(compiler, tool_call_grammar(fmt, TOOLS), text)
    g = tool_call_grammar(fmt, TOOLS, parallel=True)
    assert complete(compiler, g, text)
    assert complete(compiler, g, VALID[fmt][0])  # one call is still fine
    got = get_tool_parser(fmt).extract(text)
    assert [c.name for c in got.calls] == ["read_file", "now"]


def test_hermes_seed_arguments_match_the_parser(compiler):
    g = tool_call_grammar("hermes", TOOLS, parallel=True)
    text = H_READ + "\n" + H_LIST
    assert complete(compiler, g, text)
    got = get_tool_parser("hermes").extract(text)
    assert [(c.name, c.arguments) for c in got.calls] == [
        ("read_file", '{"path": "src/Main.java"}'), ("list_dir", '{"path": "src", "depth": 2}')]


def test_grammar_starts_the_call_at_once(compiler):
    m = matcher(compiler, tool_call_grammar("hermes", TOOLS))
    assert allowed_tokens(m) == {"<", "<tool_call>"}  # no free text, no end of generation
    m = matcher(compiler, tool_call_grammar("mistral", TOOLS))
    assert allowed_tokens(m) == {"[", "[TOOL_CALLS]"}
    m = matcher(compiler, tool_call_grammar("llama3_json", TOOLS))
    assert allowed_tokens(m) == {"{", '{"'}


@pytest.mark.parametrize("fmt", TOOL_GRAMMAR_FORMATS)
def test_prefill_is_a_valid_prefix(compiler, fmt):
    prefix = tool_call_prefix(fmt)
    assert VALID[fmt][0].startswith(prefix)
    m = matcher(compiler, tool_call_grammar(fmt, TOOLS))
    assert m.accept_string(prefix)
    assert m.accept_string(VALID[fmt][0][len(prefix):])
    assert m.accept_token(EOS) and m.is_terminated()


def test_tool_call_prefix_values():
    assert {f: tool_call_prefix(f) for f in TOOL_GRAMMAR_FORMATS} == {
        "hermes": "<tool_call>\n", "llama3_json": "{", "mistral": "[TOOL_CALLS][{", "granite": "[{",
        "phi4_mini_json": "functools[{", "longcat": "<longcat_tool_call>\n", "pythonic": "[", "llama4_json": "{",
        "llama4_pythonic": "[", "qwen3_xml": "<tool_call>\n<function=", "glm47": "<tool_call>",
        "granite4": "<tool_call>\n", "mimo": "<tool_call>\n<function=", "qwen3_coder": "<tool_call>\n<function=",
        "seed_oss": "<seed:tool_call>\n<function=", "glm45": "<tool_call>",
        "minimax_m2": '<minimax:tool_call>\n<invoke name="'}


def test_named_function(compiler):
    g = tool_call_grammar("hermes", TOOLS, required_name="now")
    assert complete(compiler, g, H_NOW)
    assert not complete(compiler, g, H_READ)
    m = matcher(compiler, g)
    assert m.accept_string('<tool_call>\n{"name": "')
    assert allowed_tokens(m) == {"n"}


def test_named_function_with_parameters_forces_its_schema(compiler):
    g = tool_call_grammar("hermes", TOOLS, required_name="read_file")
    m = matcher(compiler, g)
    assert m.accept_string('<tool_call>\n{"name": "read_file", "arguments": {"path": "')
    assert allowed_tokens(m) == {"p", "s"}  # pom.xml or src/Main.java


def test_nested_schema_and_flat_tool_form(compiler):
    tools = [{"name": "edit", "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"},
                       "edits": {"type": "array", "items": {
                           "type": "object", "properties": {"line": {"type": "integer"}, "text": {"type": "string"}},
                           "required": ["line", "text"]}},
                       "dry_run": {"type": "boolean"}},
        "required": ["path", "edits"]}}]
    assert tool_functions(tools)[0][0] == "edit"
    h = tool_call_grammar("hermes", tools)
    ok = ('<tool_call>\n{"name": "edit", "arguments": {"path": "a", "edits": [{"line": 1, "text": "x"}], '
          '"dry_run": true}}\n</tool_call>')
    assert complete(compiler, h, ok)
    assert not complete(compiler, h, ok.replace('"line": 1', '"line": "1"'))
    p = tool_call_grammar("pythonic", tools)
    assert complete(compiler, p, '[edit(path="a", edits=[{"line": 1, "text": "x"}], dry_run=False)]')
    assert complete(compiler, p, '[edit(path="a", edits=[])]')
    assert not complete(compiler, p, '[edit(path="a", edits=[{"line": 1}])]')
    assert get_tool_parser("pythonic").extract('[edit(path="a", edits=[{"line": 1, "text": "x"}], dry_run=False)]') \
        .calls[0].arguments == '{"path": "a", "edits": [{"line": 1, "text": "x"}], "dry_run": false}'


def test_errors():
    with pytest.raises(ValueError, match="no tool call grammar for parser 'kimi_k2'"):
        tool_call_grammar("kimi_k2", TOOLS)
    with pytest.raises(ValueError, match="'missing', which is not in tools"):
        tool_call_grammar("hermes", TOOLS, required_name="missing")
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar("hermes", [])
    with pytest.raises(ValueError, match="function name"):
        tool_call_grammar("hermes", [{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="not a Python identifier"):
        tool_call_grammar("pythonic", [{"name": "read-file"}])
    with pytest.raises(ValueError, match="not a Python identifier"):
        tool_call_grammar("pythonic", [{"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"class": {"type": "string"}}}}])
    with pytest.raises(ValueError):
        tool_call_prefix("kimi_k2")


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_xml_forced_values_parse_with_their_types(compiler, fmt):
    text = xml_calls(fmt)["list"]
    assert complete(compiler, tool_call_grammar(fmt, TOOLS), text)
    got = get_tool_parser(fmt, tools=TOOLS).extract(text)
    assert [(c.name, c.arguments) for c in got.calls] == [("list_dir", '{"path": "a b", "depth": 2}')]
