"""kvserve's Ollama commands on the store directly (no server answers): list, show, rm, cp,
create, stop, ps and run, with Ollama's columns and messages (cmd/cmd.go), and the formatting
rules they print with (Ollama's format package, tablewriter v0.0.5's padding)."""

from __future__ import annotations

import os

import pytest

from kvserve import cli
from kvserve.ollama.client import parse_host, probe, server_url
from kvserve.ollama.format import (
    go_duration,
    human_bytes,
    human_duration,
    human_time,
    parse_go_time,
    render_table,
    show_info,
)
from kvserve.store import Store

NOW = 1_800_000_000.0  # the fixed clock of every test here


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_server(monkeypatch, tmp_path):
    """No server answers; the default store is a temporary one; the clock is fixed."""
    monkeypatch.setenv("KVSERVE_HOST", f"127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cli, "clock", lambda: NOW)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "home" / "models")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def age(store: Store, name: str, seconds: float) -> None:
    """Make ``name``'s manifest ``seconds`` older than NOW."""
    p = store.require(name).manifest_path
    os.utime(p, (NOW - seconds, NOW - seconds))


@pytest.fixture
def tiny(store, tiny_gguf, tmp_path, capsys):
    """``tiny:latest`` created from the tiny GGUF with a Modelfile (params, SYSTEM, LICENSE)."""
    mf = write(tmp_path / "Modelfile", f'FROM {tiny_gguf}\nPARAMETER temperature 0.2\nPARAMETER stop "<|im_end|>"\n'
                                       'SYSTEM You are terse.\nLICENSE """MIT License\n\nline two\nline three"""\n')
    rc, _, err = run(capsys, "create", "tiny", "-f", mf)
    assert rc == 0, err
    return store.require("tiny")


# ------------------------------------------------------------------------------ formatting


def test_human_bytes_as_ollama_formats_sizes():
    cases = {0: "0 B", 999: "999 B", 1000: "1 KB", 1500: "1.5 KB", 10_500: "10 KB", 457_600: "457 KB",
             138_000_000: "138 MB", 1_000_000_000: "1 GB", 1_950_000_000: "1.9 GB", 4_683_100_856: "4.7 GB",
             12_000_000_000_000: "12 TB"}
    assert {n: human_bytes(n) for n in cases} == cases


def test_human_time_as_ollama_words_it():
    cases = [(0.4, "Less than a second ago"), (1, "1 second ago"), (59, "59 seconds ago"),
             (60, "About a minute ago"), (150, "2 minutes ago"), (3599, "59 minutes ago"),
             (3600, "About an hour ago"), (5400, "2 hours ago"), (47 * 3600, "47 hours ago"),
             (3 * 86400, "3 days ago"), (20 * 86400, "2 weeks ago"), (100 * 86400, "3 months ago"),
             (800 * 86400, "2 years ago"), (-240, "4 minutes from now"), (-299.5, "4 minutes from now"),
             (-3600 * 24 * 365 * 292, "Forever")]
    assert [(d, human_time(NOW - d, NOW)) for d, _ in cases] == cases
    assert human_time(None, NOW) == "Never"
    assert human_duration(86400 * 365 * 3) == "3 years"


def test_go_duration_and_times():
    assert [go_duration(n) for n in (0, 999, 1500, 12_345_678, 1_234_567_891, 123_500_000_000, 3_600_000_000_000)] \
        == ["0s", "999ns", "1.5µs", "12.345678ms", "1.234567891s", "2m3.5s", "1h0m0s"]
    assert parse_go_time("2027-01-15T08:00:00.123456789Z") == pytest.approx(1800000000.123456, abs=1e-6)
    assert parse_go_time("2027-01-15T09:00:00+01:00") == 1_800_000_000.0
    assert parse_go_time("0001-01-01T00:00:00Z") is None and parse_go_time("nonsense") is None


def test_tables_pad_as_tablewriter_does():
    assert render_table([], ["NAME", "ID", "SIZE", "MODIFIED"]) == "NAME    ID    SIZE    MODIFIED \n"
    assert render_table([["a:latest", "0123456789ab", "1 KB", "2 minutes ago"]], ["NAME", "ID", "SIZE", "MODIFIED"]) \
        == ("NAME        ID              SIZE    MODIFIED      \n"
            "a:latest    0123456789ab    1 KB    2 minutes ago    \n")
    # no header, an empty first column (ollama show), rows of different lengths
    assert render_table([["", "stop", '"a"'], ["", "temperature", "0.2"], ["", "x"]]) == \
        '    stop           "a"    \n    temperature    0.2    \n    x              \n'
    # a cell wider than the column limit wraps at blanks, the others pad with two blanks
    assert render_table([["", "one two three four five six seven", "x"]], col_width=10) == \
        ("    one two       x    \n"
         "      three four          \n"
         "      five six            \n"
         "      seven               \n")


def test_server_url_takes_ollamas_forms():
    assert server_url({}) == "http://127.0.0.1:8080"
    assert server_url({"KVSERVE_HOST": "0.0.0.0:9000", "OLLAMA_HOST": "x:1"}) == "http://127.0.0.1:9000"
    assert server_url({"OLLAMA_HOST": "example.com"}) == "http://example.com:11434"
    assert server_url({"KVSERVE_HOST": "example.com"}) == "http://example.com:8080"
    assert parse_host("http://example.com", 11434) == "http://example.com:80"
    assert parse_host("https://example.com", 11434) == "https://example.com:443"
    assert parse_host("https://example.com:8443/base", 11434) == "https://example.com:8443/base"
    assert parse_host(":7000", 11434) == "http://127.0.0.1:7000"
    assert parse_host("[::1]:7000", 11434) == "http://[::1]:7000"
    assert parse_host("::", 11434) == "http://[::1]:11434"
    assert parse_host("host:notaport", 11434) == "http://host:11434"
    assert probe(server_url(), 0.5) is False


# ------------------------------------------------------------------------------ list, show


def test_list_columns(store, tiny, capsys):
    assert run(capsys, "cp", "tiny", "myteam/coder:q4") == (0, "copied 'tiny' to 'myteam/coder:q4'\n", "")
    age(store, "tiny", 150)
    age(store, "myteam/coder:q4", 3 * 86400)
    d = store.require("tiny").digest[:12]
    rc, out, err = run(capsys, "list")
    assert (rc, err) == (0, "")
    assert out == ("NAME               ID              SIZE      MODIFIED      \n"
                   f"tiny:latest        {d}    457 KB    2 minutes ago    \n"
                   f"myteam/coder:q4    {d}    457 KB    3 days ago       \n")
    assert run(capsys, "ls", "MYT")[1] == ("NAME               ID              SIZE      MODIFIED   \n"
                                           f"myteam/coder:q4    {d}    457 KB    3 days ago    \n")
    assert run(capsys, "list", "zzz")[1] == "NAME    ID    SIZE    MODIFIED \n"


def test_show_sections(tiny, capsys):
    rc, out, _ = run(capsys, "show", "tiny")
    assert rc == 0
    assert out == ("  Model\n"
                   "    architecture        llama      \n"
                   "    parameters          113K       \n"
                   "    context length      512        \n"
                   "    embedding length    64         \n"
                   "    quantization        unknown    \n"
                   "\n"
                   "  Capabilities\n"
                   "    completion    \n"
                   "\n"
                   "  Parameters\n"
                   '    stop           "<|im_end|>"    \n'
                   "    temperature    0.2             \n"
                   "\n"
                   "  System\n"
                   "    You are terse.    \n"
                   "\n"
                   "  License\n"
                   "    MIT License    \n"
                   "    line two       \n"
                   "    ...            \n"
                   "\n")
    assert run(capsys, "show", "tiny", "--parameters")[1] == \
        'stop                           "<|im_end|>"\ntemperature                    0.2\n'
    assert run(capsys, "show", "tiny", "--system")[1] == "You are terse."
    assert run(capsys, "show", "tiny", "--license")[1] == "MIT License\n\nline two\nline three\n"
    assert run(capsys, "show", "tiny", "--template")[1].startswith("{%- for message in messages -%}")
    modelfile = run(capsys, "show", "tiny", "--modelfile")[1]
    assert modelfile.startswith('# Modelfile generated by "ollama show"\n# To build a new Modelfile based on this, '
                                'replace FROM with:\n# FROM tiny:latest\n\nFROM ')
    assert tiny.manifest.layer("model").digest.replace(":", "-") in modelfile
    assert "\nSYSTEM You are terse.\nPARAMETER stop <|im_end|>\nPARAMETER temperature 0.2\n" in modelfile
    verbose = run(capsys, "show", "tiny", "-v")[1]
    assert "  Metadata\n" in verbose and "    llama.block_count " in verbose
    assert "    tokenizer.ggml.tokens                     [<|endoftext|> ...+300 more]" in verbose
    assert "  Tensors\n" in verbose and "    blk.0.attn_q.weight" in verbose


def test_show_errors(tiny, capsys):
    assert run(capsys, "show", "nothere") == (1, "", "Error: model 'nothere' not found\n")
    assert run(capsys, "show", "tiny", "--system", "--license") == \
        (1, "", ("Error: only one of '--license', '--modelfile', '--parameters', '--system', or '--template' "
                 "can be specified\n"))
    assert run(capsys, "show", "bad name!") == (1, "", "Error: invalid model name\n")
    rc, _, err = run(capsys, "show")
    assert rc == 1 and err.startswith("Error: the following arguments are required: MODEL")


# ------------------------------------------------------------------------------ rm, cp, create


def test_create_statuses_and_a_derived_model_shares_the_weights(store, tiny_gguf, tmp_path, capsys):
    mf = write(tmp_path / "Modelfile", f"FROM {tiny_gguf}\nPARAMETER temperature 0.2\n")
    rc, out, err = run(capsys, "create", "base", "-f", mf)
    base = store.require("base")
    weights, params = base.manifest.layer("model").digest, base.manifest.layer("params").digest
    assert (rc, out) == (0, "")
    assert err.splitlines() == ["gathering model components", f"copying file {weights} 0%",
                                f"copying file {weights} 100%", "parsing GGUF", f"using existing layer {weights}",
                                f"creating new layer {params}", "writing manifest", "success"]
    # the GGUF is hard-linked into the store, not copied
    assert os.stat(tiny_gguf).st_ino == os.stat(store.blob_path(weights)).st_ino

    mf2 = write(tmp_path / "Modelfile2", 'FROM base\nSYSTEM """Be kind."""\nPARAMETER top_k 5\n')
    rc, _, err = run(capsys, "create", "kind", "-f", mf2)
    kind = store.require("kind").manifest
    system, params2 = kind.layer("system").digest, kind.layer("params").digest
    assert rc == 0
    assert err.splitlines() == ["gathering model components", f"using existing layer {weights}",
                                f"creating new layer {system}", f"creating new layer {params2}",
                                "writing manifest", "success"]
    assert kind.layer("model").digest == weights and kind.layer("model").from_ == "base:latest"
    assert store.params("kind") == {"temperature": 0.2, "top_k": 5}
    assert store.require("kind").size - store.require("base").size < 200  # kilobytes, not the weights again

    # creating again reuses every layer
    assert run(capsys, "create", "kind", "-f", mf2)[2].splitlines()[2:4] == \
        [f"using existing layer {system}", f"using existing layer {params2}"]
    # deleting the base keeps what the derived model uses
    assert run(capsys, "rm", "base") == (0, "deleted 'base'\n", "")
    assert store.has_blob(weights) and not store.has_blob(params)
    assert run(capsys, "rm", "kind") == (0, "deleted 'kind'\n", "")
    assert not store.has_blob(weights) and os.path.exists(tiny_gguf)


def test_create_defaults_to_the_modelfile_here(store, tiny_gguf, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    os.link(tiny_gguf, work / "weights.gguf")
    monkeypatch.chdir(work)
    assert run(capsys, "create", "here")[0] == 0  # no Modelfile: FROM . (the directory's GGUF)
    assert store.require("here").manifest.layer("model") is not None
    write(work / "Modelfile", "FROM ./weights.gguf\nSYSTEM hi\n")
    assert run(capsys, "create", "here2")[0] == 0
    assert store.layer_text("here2", "system") == "hi"


@pytest.mark.parametrize("text, error", [
    ("FROM {gguf}\nADAPTER ./lora.gguf\n", "(line 2): no such file or directory: ./lora.gguf"),
    ("FROM {gguf}\nDRAFT ./small.gguf\n", "(line 2): DRAFT is not supported yet: kvserve has no draft-model speculative decoding (prompt lookup: kvserve serve --spec-type ngram)"),
    ("FROM nothere\n", "model 'nothere' not found"),
    ("FROM ./missing.gguf\n", "(line 1): no such file or directory: ./missing.gguf"),
    ("FROM {gguf}\nPARAMETER top_k many\n", 'invalid int value [many]'),
    ("FROM {gguf}\nFLY away\n", ('(line 2): command must be one of "from", "license", "template", "system", '
                                 '"adapter", "draft", "renderer", "parser", "parameter", "message", "requires", or '
                                 '"capability"')),
    ("FROM {gguf}\nTEMPLATE {{{{ .Prompt\n", "template error"),
    ("PARAMETER top_k 3\n", "no FROM line"),
])
def test_create_refuses_clearly(store, tiny_gguf, tmp_path, capsys, text, error):
    mf = write(tmp_path / "Modelfile", text.format(gguf=tiny_gguf))
    rc, out, err = run(capsys, "create", "m", "-f", mf)
    assert (rc, out) == (1, "")
    assert err.splitlines()[-1].startswith("Error: ") and error in err.splitlines()[-1]
    assert store.get("m") is None


def test_create_argument_errors(tiny_gguf, tmp_path, capsys):
    assert run(capsys, "create", "m", "-f", str(tmp_path / "nope")) == \
        (1, "", "Error: specified Modelfile wasn't found\n")
    assert run(capsys, "create", "bad name!", "-f", str(tmp_path / "nope")) == \
        (1, "", "Error: invalid model name: bad name!\n")
    mf = write(tmp_path / "Modelfile", f"FROM {tiny_gguf}\n")
    rc, _, err = run(capsys, "create", "m", "-f", mf, "-q", "q4_K_M")
    assert rc == 1 and err.startswith("Error: quantize is not supported yet")


def test_rm_and_cp_messages(store, tiny, capsys):
    assert run(capsys, "cp", "tiny", "tiny2") == (0, "copied 'tiny' to 'tiny2'\n", "")
    assert store.require("tiny2").digest == tiny.digest
    assert run(capsys, "cp", "nothere", "x") == (1, "", 'Error: model "nothere" not found\n')
    assert run(capsys, "cp", "tiny", "bad name!") == (1, "", 'Error: destination "bad name!" is invalid\n')
    assert run(capsys, "rm", "tiny2", "nothere", "tiny") == \
        (1, "deleted 'tiny2'\n", "Error: model 'nothere' not found\n")
    assert store.get("tiny") is not None and store.get("tiny2") is None
    assert run(capsys, "rm", "bad name!") == (1, "", 'Error: name "bad name!" is invalid\n')


def test_engine_model_listed_shown_and_removed(store, tiny, tmp_path, capsys):
    """A model created with an ENGINE line (kvserve.supervisor.modelfile) is in ``kvserve list``
    (no ID or size: its files are the engine's), ``kvserve show`` prints its engine command with
    key-like values ``***`` (environment assignments, ``--api-key``, key-shaped words), and
    ``kvserve rm`` deletes it (then list and show no longer know it)."""
    mf = write(tmp_path / "Modelfile.engine", "FROM ./weights\nENGINE env HF_TOKEN=hf_abcdefghijklmnop PATH=/usr/bin "
               "vllm serve {model} --api-key s3cret --hf-token=abc --tokenizer tok --port {port} "
               "--header 'Authorization: Bearer sk-abcdefghijklmnop'\n")
    (tmp_path / "weights").mkdir()
    rc, _, err = run(capsys, "create", "eng", "-f", mf)
    assert rc == 0, err
    shown = ("env 'HF_TOKEN=***' PATH=/usr/bin vllm serve '{model}' --api-key '***' '--hf-token=***' "
             "--tokenizer tok --port '{port}' --header 'Authorization: Bearer ***'")
    assert err.endswith(f"writing engine definition: {shown}\nsuccess\n")  # create echoes it redacted too
    assert "hf_abc" not in err and "s3cret" not in err
    defn = store.root / "kvserve" / "engines" / "eng%3Alatest.json"
    os.utime(defn, (NOW - 7200, NOW - 7200))
    age(store, "tiny", 150)
    d = tiny.digest[:12]
    rc, out, err = run(capsys, "list")
    assert (rc, err) == (0, "")
    assert out == ("NAME           ID              SIZE      MODIFIED      \n"
                   f"tiny:latest    {d}    457 KB    2 minutes ago    \n"
                   "eng:latest     -               -         2 hours ago      \n")
    assert run(capsys, "ls", "en")[1] == ("NAME          ID    SIZE    MODIFIED    \n"
                                          "eng:latest    -     -       2 hours ago    \n")
    rc, out, err = run(capsys, "show", "eng")
    assert (rc, err) == (0, "")
    assert out == ("  Model\n"
                   f"    Engine          {shown}    \n"
                   f"    Engine model    {str(tmp_path / 'weights').ljust(len(shown))}    \n"
                   "\n"
                   "  Capabilities\n"
                   "    completion    \n"
                   "    tools         \n"
                   "\n")
    assert run(capsys, "show", "eng", "--modelfile") == (0, f"FROM {tmp_path / 'weights'}\nENGINE {shown}\n\n", "")
    assert run(capsys, "rm", "eng") == (0, "deleted 'eng'\n", "")
    assert not defn.exists()
    assert run(capsys, "list")[1] == ("NAME           ID              SIZE      MODIFIED      \n"
                                      f"tiny:latest    {d}    457 KB    2 minutes ago    \n")
    assert run(capsys, "show", "eng") == (1, "", "Error: model 'eng' not found\n")
    assert run(capsys, "rm", "eng") == (1, "", "Error: model 'eng' not found\n")


# ------------------------------------------------------------------------------ ps, stop, run


def test_ps_and_stop_without_a_server(tiny, capsys):
    rc, out, err = run(capsys, "ps")
    assert (rc, out) == (0, "NAME    ID    SIZE    PROCESSOR    CONTEXT    UNTIL \n")
    assert err.endswith(": nothing is loaded\n")
    assert run(capsys, "stop", "tiny") == (0, "", "")  # nothing to stop
    assert run(capsys, "stop", "nothere") == (1, "", "Error: couldn't find model \"nothere\" to stop\n")


def test_run_one_prompt_in_process(tiny_gguf, store, tmp_path, capsys):
    rc, out, err = run(capsys, "run", tiny_gguf, "Hello", "-n", "6")
    assert rc == 0, err
    assert out.endswith("\n") and len(out) > 1
    again = run(capsys, "run", tiny_gguf, "Hello", "-n", "6")[1]
    assert again == out  # greedy by default in-process
    assert run(capsys, "run", "tiny", "Hello", "-n", "6")[0] == 1  # not stored yet
    assert run(capsys, "create", "tiny", "-f", write(tmp_path / "Modelfile", f"FROM {tiny_gguf}\n"))[0] == 0
    assert run(capsys, "run", "tiny", "Hello", "-n", "6", "--models-dir", str(store.root)) == (0, out, "")
    rc, _, err = run(capsys, "run", tiny_gguf, "Hello", "--think=maybe")
    assert rc == 1 and err.startswith('Error: invalid value for --think: "maybe"')


def test_unknown_command_and_help(capsys):
    assert cli.main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err
    assert cli.main(["list", "--help"]) == 0


# --------------------------------------------------- the server path, against a stand-in API


class StandIn:
    """What :class:`kvserve.ollama.client.ServerApi` returns, canned (Ollama's documented shapes)."""

    base_url = "http://stand-in"

    def __init__(self):
        self.calls: list = []

    def ps(self):
        return {"models": [
            {"name": "smollm2:latest", "model": "smollm2:latest", "size": 350_000_000, "digest": "f" * 64,
             "details": {}, "expires_at": "2027-01-15T08:04:00.5Z", "size_vram": 0, "context_length": 4096},
            {"name": "big:latest", "model": "big:latest", "size": 8_000_000_000, "digest": "a" * 64,
             "details": {}, "expires_at": "2318-04-11T23:47:16.854775807Z", "size_vram": 4_160_000_000,
             "context_length": 131072},
            {"name": "old:latest", "model": "old:latest", "size": 1_000, "digest": "b" * 64, "details": {},
             "expires_at": "2027-01-15T07:59:00Z", "size_vram": 1_000, "context_length": 2048}]}

    def generate(self, body):
        self.calls.append(("generate", body))
        if body["model"] == "nothere":
            from kvserve.ollama.client import _error

            raise _error("model 'nothere' not found", 404)
        yield {"model": body["model"], "done": True, "done_reason": "unload"}

    def delete(self, name):
        self.calls.append(("delete", name))


@pytest.fixture
def stand_in(monkeypatch):
    api = StandIn()
    monkeypatch.setattr(cli, "_server", lambda: api)
    monkeypatch.setattr(cli, "_is_server", lambda a: a is api)
    return api


def test_ps_columns_from_a_server(stand_in, capsys):
    rc, out, err = run(capsys, "ps")
    assert (rc, err) == (0, "")
    assert out == ("NAME              ID              SIZE      PROCESSOR          CONTEXT    UNTIL              \n"
                   "smollm2:latest    ffffffffffff    350 MB    100% CPU           4096       4 minutes from now    \n"
                   "big:latest        aaaaaaaaaaaa    8 GB      48%/52% CPU/GPU    131072     Forever               \n"
                   "old:latest        bbbbbbbbbbbb    1 KB      100% GPU           2048       Stopping...           \n")
    assert run(capsys, "ps", "big")[1].splitlines()[1].startswith("big:latest    aaaaaaaaaaaa    8 GB    48%/52%")


def test_stop_and_rm_unload_through_the_server(stand_in, capsys):
    assert run(capsys, "stop", "smollm2") == (0, "", "")
    assert stand_in.calls == [("generate", {"model": "smollm2", "keep_alive": 0})]
    assert run(capsys, "stop", "nothere") == (1, "", "Error: couldn't find model \"nothere\" to stop\n")
    stand_in.calls.clear()
    assert run(capsys, "rm", "smollm2") == (0, "deleted 'smollm2'\n", "")
    assert stand_in.calls == [("generate", {"model": "smollm2", "keep_alive": 0}), ("delete", "smollm2")]


def test_show_info_of_a_served_model_without_model_info():
    resp = {"details": {"family": "llama", "parameter_size": "135M", "quantization_level": "Q4_1"},
            "capabilities": ["completion", "tools"], "requires": "0.14.0"}
    assert show_info(resp) == ("  Model\n"
                               "    architecture    llama     \n"
                               "    parameters      135M      \n"
                               "    quantization    Q4_1      \n"
                               "    requires        0.14.0    \n"
                               "\n"
                               "  Capabilities\n"
                               "    completion    \n"
                               "    tools         \n"
                               "\n")


def test_run_in_process_applies_the_modelfile_layers(tiny_gguf, store, tmp_path, capsys, monkeypatch):
    """In-process ``kvserve run`` renders and samples as a server's /api/chat would: the
    model's SYSTEM, MESSAGE turns, TEMPLATE and PARAMETERs apply, the flags over them."""
    from kvserve.chat import prompt
    from kvserve.engine import request

    seen: list = []
    real_render, real_request = prompt.render_chat, request.Request

    def render(template, tok, messages, *args, **kwargs):
        text, ids = real_render(template, tok, messages, *args, **kwargs)
        seen.append(("render", type(template).__name__, [dict(m) for m in messages], text))
        return text, ids

    def make_request(rid, ids, params, *args, **kwargs):
        seen.append(("params", params.n_predict, params.temperature, params.top_k, params.stop))
        return real_request(rid, ids, params, *args, **kwargs)

    monkeypatch.setattr(prompt, "render_chat", render)
    monkeypatch.setattr(request, "Request", make_request)
    mf = write(tmp_path / "Modelfile", f'FROM {tiny_gguf}\nSYSTEM "You are terse."\nPARAMETER num_predict 3\n'
               "PARAMETER top_k 7\nPARAMETER stop <end>\nMESSAGE user hi\nMESSAGE assistant yo\n")
    assert run(capsys, "create", "layered", "-f", mf, "--models-dir", str(store.root))[0] == 0
    rc, _, err = run(capsys, "run", "layered", "Hello", "--models-dir", str(store.root))
    assert rc == 0, err
    assert seen[0][:3] == ("render", "ChatTemplate", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "Hello"}])
    assert seen[1] == ("params", 3, 0.0, 7, ("<end>",))  # greedy in-process unless the Modelfile says
    seen.clear()
    # the flags win over the layers; -sys replaces the SYSTEM layer
    rc, _, err = run(capsys, "run", "layered", "Hello", "-n", "2", "--temp", "0.5", "-sys", "Be kind.",
                     "--models-dir", str(store.root))
    assert rc == 0, err
    assert seen[0][2][0] == {"role": "system", "content": "Be kind."}
    assert seen[1] == ("params", 2, 0.5, 7, ("<end>",))
    seen.clear()
    # a TEMPLATE layer renders as Ollama's Go template
    mf = write(tmp_path / "Modelfile2", f'FROM {tiny_gguf}\nTEMPLATE "{{{{ .System }}}}|{{{{ .Prompt }}}}"\n'
               'SYSTEM "S"\n')
    assert run(capsys, "create", "templated", "-f", mf, "--models-dir", str(store.root))[0] == 0
    rc, _, err = run(capsys, "run", "templated", "Hello", "-n", "1", "--models-dir", str(store.root))
    assert rc == 0, err
    assert seen[0][1] == "GoChatTemplate" and seen[0][3] == "S|Hello"


def test_run_in_process_refuses_a_kvserve_mmap_typo(tiny_gguf, capsys, monkeypatch):
    """Before: ``kvserve run FILE`` loaded the weights in the default mode whatever KVSERVE_MMAP
    said (``kvserve serve`` stops on a typo). Now it prints serve's line and exits 1, loading nothing."""
    from kvserve.loaders import gguf

    loads = []
    monkeypatch.setattr(gguf, "_load_weight_memory", lambda *a: loads.append(a) or [][0])
    monkeypatch.setenv("KVSERVE_MMAP", "ture")
    assert run(capsys, "run", tiny_gguf, "Hello", "-n", "2") == (
        1, "", "Error: error while handling environment variable \"KVSERVE_MMAP\": invalid value 'ture' (accepted: "
        "1, true, on, yes = --mmap; 0, false, off, no = --no-mmap; auto or empty = the default)\n")
    assert loads == []


def test_run_in_process_applies_parameter_use_mmap(tiny_gguf, store, tmp_path, capsys, monkeypatch):
    """A store model's PARAMETER use_mmap picks how ``kvserve run`` holds its weights, as a server
    loads it (before: ignored); the process's mode is put back after the load."""
    from kvserve.loaders import gguf

    modes = []
    real = gguf._load_weight_memory
    monkeypatch.setattr(gguf, "_load_weight_memory", lambda *a: modes.append(gguf._weight_memory()) or real(*a))
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    for name, param in (("tiny-read", "false"), ("tiny-map", "true")):
        mf = write(tmp_path / f"Modelfile-{name}", f"FROM {tiny_gguf}\nPARAMETER use_mmap {param}\n")
        assert run(capsys, "create", name, "-f", mf)[0] == 0
        rc, out, err = run(capsys, "run", name, "Hello", "-n", "2", "--models-dir", str(store.root))
        assert rc == 0 and len(out) > 1, err
    assert modes == ["read", "mmap"]
    assert gguf._WEIGHT_MEMORY == "auto"
