"""Modelfile parsing (kvserve.ollama.modelfile): Ollama's parser/parser.go grammar, PARAMETER typing
(api.Options), the text written back (Modelfile.String, `ollama show --modelfile`) and the layers
a create step writes."""

from __future__ import annotations

import codecs
import json

import pytest

from kvserve.errors import InvalidInputError, NotFoundError, NotSupportedError
from kvserve.ollama import Modelfile, ModelfileError, parse_modelfile
from kvserve.ollama.modelfile import (Message, classify_from, messages_layer, params_layer, parse_parameter,
                                      quote, resolve_from, show_modelfile, show_parameters, text_layers)

LLAMA3_TEMPLATE = ("{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
                   "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>")


def cmds(mf: Modelfile) -> list[tuple[str, str]]:
    return [(c.name, c.args) for c in mf.commands]


# --------------------------------------------------------------------------------------------
# Grammar


def test_seed_example():
    mf = parse_modelfile("FROM qwen2.5-coder:7b\nPARAMETER num_ctx 16384\nPARAMETER temperature 0.2\n")
    assert mf.from_ == "qwen2.5-coder:7b"
    assert mf.parameters == {"num_ctx": 16384, "temperature": 0.2}
    assert [c.line for c in mf.commands] == [1, 2, 3]


def test_commands_values_and_triple_quotes():
    text = ('\nFROM model1\nADAPTER adapter1\nLICENSE MIT\nPARAMETER num_ctx 2048\nPARAMETER stop "<|eot_id|>"\n'
            'TEMPLATE """' + LLAMA3_TEMPLATE + '"""    \n')
    mf = parse_modelfile(text)
    assert cmds(mf) == [("model", "model1"), ("adapter", "adapter1"), ("license", "MIT"), ("num_ctx", "2048"),
                        ("stop", "<|eot_id|>"), ("template", LLAMA3_TEMPLATE)]
    assert mf.template == LLAMA3_TEMPLATE and mf.adapters == ["adapter1"] and mf.licenses == ["MIT"]
    assert mf.commands[-1].line == 7


@pytest.mark.parametrize("text, value", [
    ('FROM "FOO  BAR  "', "FOO  BAR  "),          # quotes keep blanks
    ("FROM     FOOO BAR    ", "FOOO BAR"),         # blanks around a value go, spaces inside stay
    ("FROM /what/is/the path ", "/what/is/the path"),
    ("FROM llama3:7b-instruct-q4_K_M", "llama3:7b-instruct-q4_K_M"),
    ("FROM x # not a comment", "x # not a comment"),
    ("FROM\tx", "x"),
])
def test_from_values(text, value):
    assert cmds(parse_modelfile(text)) == [("model", value)]


@pytest.mark.parametrize("text, system", [
    ('SYSTEM """\nThis is a\nmultiline system.\n"""\n', "\nThis is a\nmultiline system.\n"),
    ('SYSTEM """This is a\nmultiline system."""\n', "This is a\nmultiline system."),
    ('SYSTEM """\nwith "quotes".\n"""', '\nwith "quotes".\n'),
    ('SYSTEM """"""\n', ""),
    ('SYSTEM ""\n', ""),
    ('SYSTEM "\'"\n', "'"),
    ('SYSTEM """\'\'"\'""\'""\'"\'\'\'\'\'""\'""\'"""\n', '\'\'"\'""\'""\'"\'\'\'\'\'""\'""\''),
    ('SYSTEM "a\n  b  "\n', "a\n  b  "),
    ('SYSTEM """   padded   """\n', "   padded   "),
    ("SYSTEM \n", ""),
    ("SYSTEM tab\there\n", "tab\there"),
])
def test_quoted_values(text, system):
    assert parse_modelfile("FROM foo\n" + text).system == system


def test_case_insensitive_commands_comments_and_blank_lines():
    mf = parse_modelfile("# header\n\n   # indented comment\nfrom base\nSystem hi\nparameter seed 42\n\tmessage user yo\n")
    assert cmds(mf) == [("model", "base"), ("system", "hi"), ("seed", "42"), ("message", "user: yo")]


def test_messages():
    mf = parse_modelfile('FROM foo\nMESSAGE system You are a file parser.\nMESSAGE user Hey there!\n'
                         'MESSAGE assistant """\nHello, I want to parse all the things!\n"""\n')
    assert mf.messages == [Message("system", "You are a file parser."), Message("user", "Hey there!"),
                           Message("assistant", "\nHello, I want to parse all the things!\n")]


def test_crlf_bom_utf16_and_non_printable_characters():
    mf = parse_modelfile(b"\xef\xbb\xbfFROM bob\r\nPARAMETER num_ctx 4096\r\nSYSTEM \"\"\"a\r\nb\"\"\"\r\n")
    assert cmds(mf) == [("model", "bob"), ("num_ctx", "4096"), ("system", "a\r\nb")]
    data = "FROM bob\nSYSTEM You are a utf16 file. 你好👋\n"
    for bom, codec in ((codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        assert parse_modelfile(bom + data.encode(codec)).system == "You are a utf16 file. 你好👋"
    # Go's strconv.IsPrint drops controls and format characters, as Ollama does
    assert parse_modelfile("FROM a\u200bb\x00c\n").from_ == "abc"


@pytest.mark.parametrize("text, line, message", [
    ("FROM foo\nBADCOMMAND param1 value1\n", 2, 'command must be one of "from", "license", "template"'),
    ("\nFROM foo\nMESSAGE badguy I'm a bad guy!\n", 3, 'message role must be one of "system", "user", or "assistant"'),
    ("FROM foo\nMESSAGE system\n", 2, "unexpected EOF"),
    ("FROM foo\nMESSAGE system", 2, "unexpected EOF"),
    ("FROM foo\nPARAMETER param1\n", 2, "unexpected EOF: param1"),
    ("FROM foo\nPARAMETER num-ctx 1\n", 2, "unexpected EOF: num"),
    ('FROM foo\nSYSTEM """This is a multiline system.""\n', 2, "unexpected EOF"),
    ('FROM foo\nSYSTEM "\n\n', 2, "unexpected EOF"),
    ('FROM foo\nSYSTEM "a" b\n', 2, "unexpected EOF"),           # text after the closing quote
    ("FROM foo\nFROM\nSYSTEM x\n", 2, "command must be one of"),  # the line of the command, not the next
    ("FROM foo\r\n\r\nBAD x\r\n", 3, "command must be one of"),   # CRLF is one line end
    ("FROM foo\nSYSTEM", 2, "unexpected EOF"),
])
def test_syntax_errors_name_the_line(text, line, message):
    with pytest.raises(ModelfileError) as e:
        parse_modelfile(text)
    assert e.value.line == line
    assert str(e.value).startswith(f"(line {line}): {message}")


@pytest.mark.parametrize("text", ["", "PARAMETER num_ctx 1\n", "# only a comment\n", "SYSTEM x\n"])
def test_no_from_line(text):
    with pytest.raises(ModelfileError, match="^no FROM line$"):
        parse_modelfile(text)


def test_from_may_come_last():
    assert cmds(parse_modelfile("PARAMETER seed 1\nFROM foo")) == [("seed", "1"), ("model", "foo")]


# --------------------------------------------------------------------------------------------
# PARAMETER typing (api.Options)


@pytest.mark.parametrize("name, value, typed", [
    ("num_ctx", "1", 1), ("num_batch", "512", 512), ("num_gpu", "-1", -1), ("main_gpu", "0", 0),
    ("use_mmap", "true", True), ("use_mmap", "F", False), ("use_mmap", "0", False), ("num_thread", "8", 8),
    ("num_keep", "4", 4), ("seed", "-1", -1), ("num_predict", "+128", 128), ("top_k", "40", 40),
    ("top_p", "1.0", 1.0), ("min_p", "0.05", 0.05), ("typical_p", ".5", 0.5), ("repeat_last_n", "64", 64),
    ("temperature", "0.1", 0.1), ("temperature", "1e-1", 0.1), ("temperature", "0x1p-2", 0.25),
    ("repeat_penalty", "1.1", 1.1), ("presence_penalty", "1_000", 1000.0), ("frequency_penalty", "-2", -2.0),
    ("draft_num_predict", "4", 4),
    # float32 precision, kept with the digits Ollama's client sends
    ("temperature", "0.123456789", 0.12345679),
    ("stop", "### User:", ["### User:"]),
])
def test_parameter_types(name, value, typed):
    got = parse_parameter(name, value)
    assert got == typed and type(got) is type(typed)


@pytest.mark.parametrize("name, value, message", [
    ("num_ctx", "1.5", "invalid int value [1.5]"),
    ("num_ctx", "1_000", "invalid int value [1_000]"),
    ("num_ctx", "0x10", "invalid int value [0x10]"),
    ("seed", "9223372036854775808", "invalid int value [9223372036854775808]"),
    ("temperature", "hot", "invalid float value [hot]"),
    ("temperature", "1e39", "invalid float value [1e39]"),   # beyond float32
    ("temperature", "inf", "invalid float value [inf]"),     # JSON has no infinities
    ("temperature", "nan", "invalid float value [nan]"),
    ("use_mmap", "yes", "invalid bool value [yes]"),
    ("numa", "true", "unknown parameter 'numa'"),
    ("Temperature", "1", "unknown parameter 'Temperature'"),  # names are case-sensitive
])
def test_parameter_errors(name, value, message):
    with pytest.raises(ModelfileError, match=r"^\(line 3\): " + message.replace("[", r"\[").replace("]", r"\]")):
        parse_parameter(name, value, 3)


def test_parameter_errors_name_the_line_in_a_file():
    with pytest.raises(ModelfileError) as e:
        parse_modelfile("FROM x\n\nPARAMETER temperature 0.2\nPARAMETER top_k high\n")
    assert e.value.line == 4 and str(e.value) == "(line 4): invalid int value [high]"


def test_stop_repeats_into_a_list_and_other_parameters_keep_the_last():
    mf = parse_modelfile('FROM x\nPARAMETER stop <|im_end|>\nPARAMETER temperature 0.5\nPARAMETER stop "### User: "\n'
                         "PARAMETER temperature 0.7\n")
    assert mf.parameters == {"stop": ["<|im_end|>", "### User: "], "temperature": 0.7}


def test_deprecated_parameters_are_dropped_with_a_warning():
    mf = parse_modelfile("FROM x\nPARAMETER mirostat 2\nPARAMETER penalize_newline true\n")
    assert mf.parameters == {}
    assert mf.warnings == ["(line 2): parameter mirostat is deprecated", "(line 3): parameter penalize_newline is deprecated"]


# --------------------------------------------------------------------------------------------
# REQUIRES, CAPABILITY, ADAPTER, DRAFT, RENDERER, PARSER


def test_requires():
    assert parse_modelfile("FROM x\nREQUIRES 0.14.0").requires == "0.14.0"
    assert parse_modelfile("FROM x\nREQUIRES v0.14").requires == "0.14"
    for bad in ("banana", "0.14.0.1", "01.2.3", "0.14.0-01"):
        with pytest.raises(ModelfileError, match=r"\(line 2\): requires must be a valid semver \(e.g. 0.14.0\)"):
            parse_modelfile(f"FROM x\nREQUIRES {bad}")


def test_capabilities_renderer_parser_are_kept():
    mf = parse_modelfile("FROM x\nCAPABILITY tools\nCAPABILITY thinking\nCAPABILITY tools\nRENDERER qwen3-coder\nPARSER qwen3-coder\n")
    assert mf.capabilities == ["tools", "thinking"]
    assert (mf.renderer, mf.parser) == ("qwen3-coder", "qwen3-coder")
    with pytest.raises(ModelfileError, match=r'\(line 2\): capability must be one of "completion", "tools"'):
        parse_modelfile("FROM x\nCAPABILITY flying\n")


def test_adapter_is_parsed_and_kept_draft_refused_by_create():
    mf = parse_modelfile("FROM x\nADAPTER ./lora.gguf\nDRAFT ./small\n")
    assert mf.adapters == ["./lora.gguf"] and mf.draft == "./small"
    with pytest.raises(NotSupportedError, match=r"^\(line 3\): DRAFT is not supported yet"):
        mf.check_supported()
    parse_modelfile("FROM x\nADAPTER ./lora.gguf\n").check_supported()  # ADAPTER: an adapter layer
    with pytest.raises(NotSupportedError, match=r"^\(line 2\): DRAFT is not supported yet"):
        parse_modelfile("FROM x\nDRAFT ./small\n").check_supported()
    parse_modelfile("FROM x\nRENDERER r\nPARSER p\nCAPABILITY tools\n").check_supported()


# --------------------------------------------------------------------------------------------
# FROM: what it names


@pytest.mark.parametrize("value, kind", [
    ("llama3.2", "model"), ("hf.co/user/repo:Q4_K_M", "model"), ("library/llama3:latest", "model"),
    ("./model.gguf", "gguf"), ("/abs/Model.GGUF", "gguf"), ("weights.gguf", "gguf"),
    ("sha256:" + "a" * 64, "blob"), ("sha256-" + "B" * 64, "blob"), ("@sha256:" + "c" * 64, "blob"),
    ("./hf-dir", "path"), ("~/models/x", "path"), (".", "path"), ("../up", "path"),
])
def test_classify_from(value, kind):
    src = classify_from(value)
    assert src.kind == kind
    if kind == "blob":
        assert src.digest == "sha256:" + value[-64:].lower()


def test_resolve_from_looks_at_the_disk(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    assert resolve_from("m.gguf", tmp_path).path == resolve_from("./m.gguf", tmp_path).path
    assert resolve_from("hf/../m.gguf", tmp_path).path == str(tmp_path / "m.gguf")
    assert resolve_from("m.gguf", tmp_path).kind == "gguf"
    assert resolve_from("m.gguf", tmp_path).path == str(tmp_path / "m.gguf")
    assert resolve_from(str(tmp_path / "hf"), "/elsewhere").kind == "directory"
    assert resolve_from("llama3.2", tmp_path).kind == "model"
    with pytest.raises(NotFoundError, match=r"\(line 4\): no such file or directory: ./missing.gguf"):
        resolve_from("./missing.gguf", tmp_path, 4)


def test_create_request_resolves_paths(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    req = parse_modelfile("FROM ./m.gguf\nSYSTEM s\n").create_request(tmp_path)
    assert req.from_ is None and req.sources[0].kind == "gguf" and req.sources[0].path == str(tmp_path / "m.gguf")
    assert req.to_json("mine", files={"m.gguf": "sha256:" + "0" * 64}) == {
        "model": "mine", "files": {"m.gguf": "sha256:" + "0" * 64}, "system": "s"}


# --------------------------------------------------------------------------------------------
# Create: the request and the layers


def test_create_request_json_is_ollamas_form():
    mf = parse_modelfile("FROM test\nPARAMETER temperature 0.5\nPARAMETER top_k 1\nSYSTEM You are a bot.\n"
                         "LICENSE license1\nLICENSE license2\nMESSAGE user Hello there!\nMESSAGE assistant Hi! How are you?\n"
                         "REQUIRES 0.14.0\nCAPABILITY tools\n")
    assert mf.create_request().to_json("bot") == {
        "model": "bot", "from": "test", "system": "You are a bot.", "license": ["license1", "license2"],
        "parameters": {"temperature": 0.5, "top_k": 1},
        "messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi! How are you?"}],
        "requires": "0.14.0", "info": {"capabilities": ["tools"]}}
    assert parse_modelfile("FROM test").create_request().to_json() == {"from": "test"}
    assert parse_modelfile("FROM sha256:" + "A" * 64).create_request().from_ == "sha256:" + "a" * 64


def test_create_request_checks_the_template():
    with pytest.raises(ModelfileError, match=r"^\(line 3\): template error: template: :1:\d+: unclosed action"):
        parse_modelfile("FROM x\n\nTEMPLATE {{ .Prompt \n").create_request()
    with pytest.raises(ModelfileError, match=r"\(line 2\): template error: .*function 'call' is not supported"):
        parse_modelfile("FROM x\nTEMPLATE {{ call .F }}\n").create_request()
    assert parse_modelfile("FROM x\nTEMPLATE {{ call .F }}\n").create_request(check_template=False).template


def test_params_layer_bytes_are_gos():
    params = parse_modelfile("FROM x\nPARAMETER temperature 0.2\nPARAMETER num_ctx 16384\nPARAMETER stop <|im_end|>\n"
                             "PARAMETER stop a&b\nPARAMETER use_mmap false\n").parameters
    assert params_layer(params) == (b'{"num_ctx":16384,"stop":["\\u003c|im_end|\\u003e","a\\u0026b"],'
                                    b'"temperature":0.2,"use_mmap":false}\n')
    # the base model's params stay unless overridden (Ollama's setParameters); a new stop replaces the list
    assert json.loads(params_layer({"stop": ["x"]}, {"stop": ["y"], "top_k": 20.0})) == {"stop": ["x"], "top_k": 20}
    assert params_layer({}) is None


def test_messages_and_text_layers():
    mf = parse_modelfile('FROM x\nTEMPLATE "{{ .Prompt }}"\nSYSTEM "<sys>"\nLICENSE MIT\nLICENSE ""\n'
                         "MESSAGE user <hi>\nMESSAGE assistant yo\n")
    req = mf.create_request()
    assert messages_layer(req.messages) == b'[{"role":"user","content":"\\u003chi\\u003e"},{"role":"assistant","content":"yo"}]\n'
    assert messages_layer([]) is None
    assert text_layers(req) == [("application/vnd.ollama.image.template", b"{{ .Prompt }}"),
                                ("application/vnd.ollama.image.system", b"<sys>"),
                                ("application/vnd.ollama.image.license", b"MIT")]


# --------------------------------------------------------------------------------------------
# Writing back


def test_round_trip_ollamas_cases():
    for text in [
        "\nFROM foo\nADAPTER adapter1\nLICENSE MIT\nPARAMETER seed 1\nPARAMETER top_k 2\nTEMPLATE template1\n"
        "MESSAGE system You are a file parser. Always parse things.\nMESSAGE user Hey there!\n",
        '\nFROM foo\nLICENSE """\nVery long and boring legal text.\nBlah blah blah.\n"Oh look, a quote!"\n"""\n\n'
        'MESSAGE system """\nYou are a store greeter. Always respond with "Hello!".\n"""\n',
        '\nFROM foo\nSYSTEM ""\n',
    ]:
        mf = parse_modelfile(text)
        assert cmds(parse_modelfile(mf.to_text())) == cmds(mf)


def test_to_text_is_ollamas_format():
    mf = parse_modelfile('FROM foo\nPARAMETER stop "<|eot_id|>"\nPARAMETER stop " x"\nSYSTEM """a\n"b\""""\n'
                         "TEMPLATE \"\"\"{{ .Prompt }}\n\"\"\"\nMESSAGE user hi there\nREQUIRES 0.14.0\n")
    assert mf.to_text() == ('FROM foo\nPARAMETER stop <|eot_id|>\nPARAMETER stop " x"\nSYSTEM """a\n"b\""""\n'
                            'TEMPLATE "{{ .Prompt }}\n"\nMESSAGE user hi there\nREQUIRES 0.14.0\n')


@pytest.mark.parametrize("value", ["", '"starts with a quote', "trailing ", "\tlead", "a\rb", 'x "y"\nz', "plain"])
def test_quote_parses_back(value):
    assert parse_modelfile(f"FROM x\nSYSTEM {quote(value)}\n").system == value


def test_show_modelfile():
    text = show_modelfile(
        short_name="java-reviewer:latest", model_path="/root/.ollama/models/blobs/sha256-aaaa",
        template=LLAMA3_TEMPLATE, system="Review Java code.",
        parameters={"num_ctx": 16384.0, "temperature": 0.2, "stop": ["<|eot_id|>", "<|start_header_id|>"],
                    "num_predict": 1048576.0},
        licenses=["MIT"], messages=[{"role": "user", "content": "hi"}])
    assert text == (
        '# Modelfile generated by "ollama show"\n'
        "# To build a new Modelfile based on this, replace FROM with:\n"
        "# FROM java-reviewer:latest\n\n"
        "FROM /root/.ollama/models/blobs/sha256-aaaa\n"
        f'TEMPLATE "{LLAMA3_TEMPLATE}"\n'
        "SYSTEM Review Java code.\n"
        "PARAMETER num_ctx 16384\n"
        "PARAMETER num_predict 1048576\n"   # Ollama would print 1.048576e+06, which it cannot parse back
        "PARAMETER stop <|eot_id|>\n"
        "PARAMETER stop <|start_header_id|>\n"
        "PARAMETER temperature 0.2\n"
        "LICENSE MIT\n"
        "MESSAGE user hi\n")
    body = text.split("\n\n", 1)[1]
    mf = parse_modelfile(body)
    assert mf.parameters == {"num_ctx": 16384, "num_predict": 1048576, "stop": ["<|eot_id|>", "<|start_header_id|>"],
                             "temperature": 0.2}
    assert mf.template == LLAMA3_TEMPLATE


def test_show_modelfile_default_template_and_optional_lines():
    text = show_modelfile(short_name="m:latest", model_path="/b/sha256-1", adapters=["/b/sha256-2"], draft="/b/sha256-3",
                          projectors=["/b/sha256-4"], renderer="r", parser="p", capabilities=["tools"])
    assert text.split("\n\n", 1)[1] == ("FROM /b/sha256-1\nADAPTER /b/sha256-2\nDRAFT /b/sha256-3\nFROM /b/sha256-4\n"
                                        "TEMPLATE {{ .Prompt }}\nRENDERER r\nPARSER p\nCAPABILITY tools\n")


def test_show_parameters():
    assert show_parameters({"temperature": 0.2, "stop": ["<|im_end|>", 'say "x"'], "num_ctx": 16384.0}) == (
        'num_ctx                        16384\n'
        'stop                           "<|im_end|>"\n'
        'stop                           "say \\"x\\""\n'
        'temperature                    0.2')
    assert show_parameters(None) == ""


def test_errors_are_invalid_input():
    with pytest.raises(InvalidInputError):
        parse_modelfile("FROM x\nBAD y\n")
