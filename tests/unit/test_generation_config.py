"""The model's own sampling defaults (kvserve/serving/generation_config.py): seed 002 Example 14's
generation_config.json merge (``--generation-config auto|vllm|DIR``, ``--override-generation-config``),
vLLM's start-up line, GGUF ``general.sampling.*`` keys, explicit flags and request fields winning,
and the defaults on every face (``/props``, ``/slots``, ``/completion``'s ``generation_settings``,
OpenAI chat, Ollama ``/api/generate`` under a store model's params layer), per loaded model.

Tiny random-weight models (tests/tinymodel.py), served in process with Starlette's TestClient."""

from __future__ import annotations

import json
import logging

import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.faces.ollama_api import ollama_options
from kvserve.faces.params import sampling_params_from_body
from kvserve.serving.args import parse_args
from kvserve.serving.generation_config import (
    diff_sampling_params,
    gguf_sampling,
    model_defaults,
    ollama_layer,
    overridden_line,
)
from kvserve.serving.state import ServerState

#: seed 002 Example 14's generation_config.json (its sampling part and two keys vLLM drops)
EXAMPLE_14 = {"bos_token_id": 151643, "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7,
              "top_k": 20, "top_p": 0.8}
#: the lines Example 14 prints
LINES_14 = [
    "--generation-config auto:  {repetition_penalty=1.05, temperature=0.7, top_k=20, top_p=0.8}",
    "--generation-config vllm:  {}",
    "auto + override top_p=0.95: {repetition_penalty=1.05, temperature=0.7, top_k=20, top_p=0.95}",
    "request {temperature=0.2} runs with: {min_p=0.0, repetition_penalty=1.05, temperature=0.2, top_k=20, top_p=0.8}",
]
LINE_AUTO = ("Default kvserve sampling parameters have been overridden by the model's `generation_config.json`: "
             "`{'repetition_penalty': 1.05, 'temperature': 0.7, 'top_k': 20, 'top_p': 0.8}`. If this is not "
             "intended, please relaunch kvserve with `--generation-config vllm`.")
GGUF_KEYS = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.95,
             "general.sampling.min_p": 0.0, "general.sampling.penalty_repeat": 1.05,
             "general.sampling.penalty_last_n": 128, "general.sampling.sequence": "penalties;top_k;top_p;temp",
             "general.sampling.mirostat": 0}
LINE_GGUF = ("Default kvserve sampling parameters have been overridden by the model's `general.sampling.*` GGUF "
             "metadata: `{'sequence': 'penalties;top_k;top_p;temp', 'top_k': 20, 'top_p': 0.95, 'min_p': 0.0, "
             "'temp': 0.6, 'penalty_last_n': 128, 'penalty_repeat': 1.05, 'mirostat': 0}`. If this is not "
             "intended, please relaunch kvserve with `--generation-config vllm`.")
KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "n_predict")
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                  "repeat_last_n": 64, "n_predict": -1}
#: ``--generation-config vllm`` typed: vLLM's neutral values (seed 002 Example 14)
VLLM_NEUTRAL_PICKED = {**LLAMA_DEFAULTS, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
MODEL_14 = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.0, "repeat_penalty": 1.05,
            "repeat_last_n": -1, "n_predict": -1}


def java_map(d: dict) -> str:
    """A map as Java's ``Map.toString`` writes it (the seed's output form)."""
    return "{" + ", ".join(f"{k}={v}" for k, v in d.items()) + "}"


def vllm_view(p: dict) -> dict:
    """Example 14's five fields of a ``generation_settings`` / ``/props`` params object, sorted."""
    return dict(sorted({"min_p": p["min_p"], "repetition_penalty": p["repeat_penalty"],
                        "temperature": p["temperature"], "top_k": p["top_k"], "top_p": p["top_p"]}.items()))


def picked(p: dict) -> dict:
    return {k: p[k] for k in KEYS}


def hf_model(d, config: dict | None = EXAMPLE_14):
    """A tiny HF directory whose generation_config.json also holds ``config``."""
    path = tinymodel.write_tiny_hf_dir(d)
    f = path / "generation_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **(config or {})}))
    return path


@pytest.fixture(scope="module")
def hf14(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("gc") / "qwen-like")


@pytest.fixture(scope="module")
def gguf_sampled(tmp_path_factory):
    return tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("gcg") / "sampled.gguf", metadata=GGUF_KEYS)


class Served:
    """One in-process server (TestClient) and the log lines it wrote while loading."""

    def __init__(self, argv: list[str], caplog=None):
        self.state = ServerState(parse_args(["-c", "512", "-np", "2", *argv], environ={}))
        self.client = TestClient(build_app(self.state), base_url="http://127.0.0.1")
        self.client.__enter__()
        if self.state.pinned:
            self.client.portal.call(self.state.preload)

    def props(self, model: str | None = None) -> dict:
        r = self.client.get("/props", params={"model": model} if model else None)
        assert r.status_code == 200, r.text
        return r.json()["default_generation_settings"]["params"]

    def close(self) -> None:
        self.client.portal.call(self.state.manager.shutdown)
        self.client.__exit__(None, None, None)


@pytest.fixture
def serve(caplog, tmp_path):
    servers: list[Served] = []

    def start(*argv: str) -> Served:
        with caplog.at_level(logging.INFO, logger="kvserve.server"):
            s = Served([*argv, "--models-dir", str(tmp_path / "models")])
        s.log = [r.getMessage() for r in caplog.records if r.name == "kvserve.server"]
        caplog.clear()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


# -- Example 14, the merge ----------------------------------------------------------------------

def test_example_14_lines(hf14):
    """The seed's four lines, from kvserve's own merge of the same file (and its request path)."""
    auto = model_defaults(parse_args(["-m", str(hf14)], environ={}), str(hf14))
    vllm = model_defaults(parse_args(["-m", str(hf14), "--generation-config", "vllm"], environ={}), str(hf14))
    over = model_defaults(parse_args(["-m", str(hf14), "--override-generation-config", '{"top_p": 0.95}'],
                                     environ={}), str(hf14))
    request = sampling_params_from_body({"temperature": 0.2}, auto.params, None)
    runs = {"min_p": request.min_p, "repetition_penalty": request.repeat_penalty,
            "temperature": request.temperature, "top_k": request.top_k, "top_p": request.top_p}
    assert [f"--generation-config auto:  {java_map(auto.diff)}", f"--generation-config vllm:  {java_map(vllm.diff)}",
            f"auto + override top_p=0.95: {java_map(over.diff)}",
            f"request {{temperature=0.2}} runs with: {java_map(dict(sorted(runs.items())))}"] == LINES_14


def test_diff_keeps_vllms_keys_in_its_order_and_renames_max_new_tokens():
    assert diff_sampling_params(EXAMPLE_14) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
                                                "top_p": 0.8}
    assert list(diff_sampling_params({"max_new_tokens": 9, "min_p": 0.1, "top_k": None, "num_beams": 4})) == \
        ["min_p", "max_tokens"]
    assert diff_sampling_params({"temperature": 0.7}, {"temperature": None, "top_p": 0.5}) == {"top_p": 0.5}
    assert diff_sampling_params({}, {}) == {}


def test_the_start_up_line_text():
    assert overridden_line({"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}) == LINE_AUTO


def test_example_14_on_the_server(serve, hf14):
    """The four settings as a real (in-process) server applies them: /props and a request."""
    auto = serve("-m", str(hf14))
    assert LINE_AUTO in auto.log
    assert picked(auto.props()) == MODEL_14
    r = auto.client.post("/completion", json={"prompt": "hi", "n_predict": 1, "temperature": 0.2})
    assert r.status_code == 200, r.text
    assert f"request {{temperature=0.2}} runs with: {java_map(vllm_view(r.json()['generation_settings']))}" == \
        LINES_14[3]

    vllm = serve("-m", str(hf14), "--generation-config", "vllm")
    assert not any("have been overridden" in line for line in vllm.log)
    assert picked(vllm.props()) == VLLM_NEUTRAL_PICKED  # the vLLM flag typed: vLLM's neutral values

    over = serve("-m", str(hf14), "--override-generation-config", '{"top_p": 0.95}')
    assert LINE_AUTO.replace("'top_p': 0.8", "'top_p': 0.95") in over.log
    assert picked(over.props()) == {**MODEL_14, "top_p": 0.95}


def test_generation_config_dir(serve, hf14, tmp_path):
    """``--generation-config DIR`` reads DIR/generation_config.json instead of the model's."""
    other = tmp_path / "gc"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "max_new_tokens": 7}))
    s = serve("-m", str(hf14), "--generation-config", str(other))
    assert picked(s.props()) == {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
                                 "repeat_last_n": 64, "n_predict": 7}
    assert any("`{'temperature': 0.5, 'max_tokens': 7}`" in line for line in s.log)


def test_generation_config_dir_must_hold_the_file(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--generation-config", "/no/such/dir"], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: invalid --generation-config '/no/such/dir': 'auto', 'vllm' or a directory holding "
        "generation_config.json (FileNotFoundError: No such file or directory)")


def test_generation_config_dir_not_an_object(tmp_path, capsys):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(SystemExit):
        parse_args(["--generation-config", str(tmp_path)], environ={})
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"{tmp_path}/generation_config.json: a JSON object expected, got list")


# -- who wins -----------------------------------------------------------------------------------

def test_a_flag_given_wins_over_the_file(hf14):
    """``--temp`` on the command line and LLAMA_ARG_TOP_K in the environment are the user's choice."""
    args = parse_args(["-m", str(hf14), "--temp", "0.3"], environ={"LLAMA_ARG_TOP_K": "5"})
    md = model_defaults(args, str(hf14))
    assert (md.params.temperature, md.params.top_k, md.params.top_p, md.params.min_p, md.params.repeat_penalty) == \
        (0.3, 5, 0.8, 0.0, 1.05)
    assert md.notes == [(logging.INFO, "flag --temp wins over the model's temperature = 0.7"),
                        (logging.INFO, "flag LLAMA_ARG_TOP_K wins over the model's top_k = 20")]
    assert md.diff == diff_sampling_params(EXAMPLE_14)  # the line shows the file, as vLLM's does
    given_min_p = model_defaults(parse_args(["-m", str(hf14), "--min-p", "0.05", "--repeat-last-n", "32"],
                                            environ={}), str(hf14)).params
    assert (given_min_p.min_p, given_min_p.repeat_last_n) == (0.05, 32)


def test_the_override_wins_over_flags_and_the_file(hf14):
    args = parse_args(["-m", str(hf14), "--temp", "0.3", "--override-generation-config",
                       '{"temperature": 0.9, "max_new_tokens": 4}'], environ={})
    p = model_defaults(args, str(hf14)).params
    assert (p.temperature, p.top_p, p.n_predict) == (0.9, 0.8, 4)


def test_request_fields_win_on_every_face(serve, hf14):
    s = serve("-m", str(hf14), "--slots")
    c = s.client
    r = c.post("/completion", json={"prompt": "hi", "n_predict": 2, "top_k": 3, "repeat_penalty": 1.3,
                                    "repeat_last_n": 8})
    g = r.json()["generation_settings"]
    assert (g["temperature"], g["top_k"], g["top_p"], g["repeat_penalty"], g["repeat_last_n"], g["n_predict"]) == \
        (0.7, 3, 0.8, 1.3, 8, 2)
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                             "temperature": 0.1, "repetition_penalty": 1.2, "id_slot": 1})
    assert r.status_code == 200, r.text
    slot = next(x for x in c.get("/slots").json() if x["id"] == 1)["params"]
    assert (slot["temperature"], slot["top_k"], slot["top_p"], slot["min_p"], slot["repeat_penalty"]) == \
        (0.1, 20, 0.8, 0.0, 1.2)
    r = c.post("/api/generate", json={"model": "x", "prompt": "hi", "stream": False,
                                      "options": {"num_predict": 1, "top_p": 0.5}})
    assert r.status_code == 200, r.text
    last = max(c.get("/slots").json(), key=lambda x: x["id_task"])["params"]
    assert (last["temperature"], last["top_k"], last["top_p"], last["repeat_penalty"]) == (0.7, 20, 0.5, 1.05)


def test_max_new_tokens_is_a_default_a_request_replaces(serve, tmp_path):
    path = hf_model(tmp_path / "m", {"max_new_tokens": 3})
    s = serve("-m", str(path))
    assert picked(s.props()) == {**LLAMA_DEFAULTS, "n_predict": 3}  # no sampling key: llama-server's stay
    r = s.client.post("/completion", json={"prompt": "hi", "ignore_eos": True})
    assert r.json()["tokens_predicted"] == 3
    r = s.client.post("/completion", json={"prompt": "hi", "ignore_eos": True, "n_predict": 5})
    assert r.json()["tokens_predicted"] == 5
    r = s.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3


def test_bad_values_in_the_file_are_skipped_with_a_warning(tmp_path):
    path = hf_model(tmp_path / "m", {"temperature": "hot", "top_p": 1.5, "top_k": -1, "min_p": None})
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert (md.params.temperature, md.params.top_p, md.params.top_k, md.params.min_p) == (1.0, 1.0, 0, 0.0)
    assert [t for _, t in md.notes] == ["the model's temperature = 'hot' is not used: a number expected",
                                        "the model's top_p = 1.5 is not used: top_p must be in [0, 1]"]
    (path / "generation_config.json").write_text("{not json")
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert md.params == parse_args([], environ={}).default_sampling_params()
    assert md.notes[0][0] == logging.WARNING and "not JSON" in md.notes[0][1]


# -- GGUF general.sampling.* ----------------------------------------------------------------------

def test_gguf_sampling_keys(serve, gguf_sampled):
    s = serve("-m", str(gguf_sampled))
    assert LINE_GGUF in s.log
    assert "model's general.sampling.mirostat = 0 is ignored: kvserve has no mirostat" in s.log
    p = s.props()
    assert picked(p) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.05,
                         "repeat_last_n": 128, "n_predict": -1}
    assert p["samplers"] == ["penalties", "top_k", "top_p", "temperature"]
    r = s.client.post("/completion", json={"prompt": "hi", "n_predict": 1, "temperature": 0.2})
    assert r.json()["generation_settings"]["temperature"] == 0.2
    off = serve("-m", str(gguf_sampled), "--generation-config", "vllm", "--top-k", "7")
    assert picked(off.props()) == {**VLLM_NEUTRAL_PICKED, "top_k": 7}
    assert not any("have been overridden" in line for line in off.log)


def test_gguf_flag_given_wins(gguf_sampled):
    md = model_defaults(parse_args(["-m", str(gguf_sampled), "--temp", "0.1", "--samplers", "top_k;temperature"],
                                   environ={}), str(gguf_sampled), _metadata(gguf_sampled))
    assert (md.params.temperature, md.params.top_k, md.params.samplers) == (0.1, 20, ("top_k", "temperature"))


def _metadata(path) -> dict:
    from kvserve.loaders.gguf import read_gguf_header

    return read_gguf_header(str(path))[0]


def test_float32_metadata_reads_at_its_shortest_decimal(gguf_sampled):
    assert gguf_sampling(_metadata(gguf_sampled))["temp"] == 0.6


def test_smollm2_has_no_sampling_keys(tiny_gguf):
    """The default model (and the tiny models) carry no ``general.sampling.*``: nothing changes."""
    import os

    from kvserve.store import resolve_model

    paths = [tiny_gguf]
    if os.environ.get("KVSERVE_SMOLLM2") or resolve_model("smollm2", pull_missing=False) is not None:
        paths.append(os.environ.get("KVSERVE_SMOLLM2") or str(resolve_model("smollm2", pull_missing=False)))
    for p in paths:
        assert gguf_sampling(_metadata(p)) == {}
        assert model_defaults(parse_args(["-m", p], environ={}), p, _metadata(p)).log_line() is None


# -- Ollama, several models ---------------------------------------------------------------------

def test_ollama_layers_the_file_under_the_params_layer(gguf_sampled):
    md = model_defaults(parse_args(["-m", str(gguf_sampled), "--temp", "0.1"], environ={}), str(gguf_sampled),
                        _metadata(gguf_sampled))
    layer = ollama_layer(md)
    assert layer == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.05,
                     "repeat_last_n": 128}  # the server's --temp does not reach the Ollama face
    got = ollama_options({**layer, "temperature": 0.3}, {"top_k": 2}).sampling
    assert (got["temperature"], got["top_k"], got["top_p"], got["repeat_last_n"]) == (0.3, 2, 0.95, 128)
    plain = ollama_options({}, None).sampling
    assert (plain["temperature"], plain["top_k"], plain["top_p"]) == (0.8, 40, 0.9)  # Ollama's own defaults


def test_every_model_has_its_own_defaults_and_ollama_sees_them(serve, tmp_path, hf14, gguf_sampled):
    """Several models (no -m): an HF directory and a store GGUF with a params layer, each its own."""
    from kvserve.store import open_store
    from kvserve.store.manifest import Layer, media_type

    store = open_store(tmp_path / "models")
    g = store.import_file(gguf_sampled)
    params = store.write_blob_bytes(json.dumps({"temperature": 0.3}).encode())
    store.create("sampled", [Layer(media_type("model"), g.digest, g.size),
                             Layer(media_type("params"), params.digest, params.size)])
    s = serve("--allow-model-paths", "--no-preload", "--slots")
    c = s.client
    r = c.post("/api/generate", json={"model": "sampled", "prompt": "hi", "stream": False,
                                      "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    slot = c.get("/slots", params={"model": "sampled"}).json()
    used = next(x["params"] for x in slot if x["id_task"] != -1)
    # the params layer's temperature over the file's 0.6; the file's top_k and top_p over Ollama's 40 and 0.9
    assert (used["temperature"], used["top_k"], used["top_p"], used["repeat_penalty"]) == (0.3, 20, 0.95, 1.05)
    assert picked(s.props("sampled"))["temperature"] == 0.6  # the other faces: the file's
    assert picked(s.props(str(hf14))) == MODEL_14
    r = c.post("/v1/completions", json={"model": str(hf14), "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


# -- a default length is capped to the context's room (vLLM's get_max_tokens) -------------------------

def test_a_default_max_new_tokens_is_capped_to_the_room_left_never_refused(serve, tmp_path):
    path = hf_model(tmp_path / "m", {"max_new_tokens": 1000})
    s = serve("-m", str(path), "-c", "64")  # 2 slots of 32 tokens
    c = s.client
    r = c.post("/completion", json={"prompt": "hi", "ignore_eos": True})
    assert r.status_code == 200, r.text
    n = r.json()["tokens_evaluated"]
    assert r.json()["tokens_predicted"] == 32 - n
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert (u["prompt_tokens"] + u["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (32, "length")
    r = c.post("/v1/responses", json={"input": "hi"})
    assert r.status_code == 200, r.text
    r = c.post("/api/generate", json={"model": "x", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] + r.json()["eval_count"] <= 32
    r = c.post("/api/chat", json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": False})
    assert r.status_code == 200, r.text
    # a request's own length keeps the check
    r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 1000})
    assert r.status_code == 400 and "exceeds the available context size" in r.text
    r = c.post("/api/generate", json={"model": "x", "prompt": "hi", "stream": False, "options": {"num_predict": 1000}})
    assert r.status_code == 400, r.text


def test_a_default_n_predict_flag_is_capped_too(serve, hf14):
    s = serve("-m", str(hf14), "-c", "64", "-n", "100")
    r = s.client.post("/completion", json={"prompt": "hi", "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] + r.json()["tokens_predicted"] == 32
    assert s.client.post("/completion", json={"prompt": "hi", "n_predict": 100}).status_code == 400


# -- what is refused, and what an ignored or refused value leaves in place -------------------------

@pytest.mark.parametrize("override", ['{"top_p": "0.5"}', '{"top_p": null}', '{"top_p": true}'])
def test_an_ignored_override_key_leaves_the_files_value(hf14, override):
    args = parse_args(["-m", str(hf14), "--override-generation-config", override], environ={})
    md = model_defaults(args, str(hf14))
    assert md.params.top_p == 0.8
    assert md.applied["top_p"] == 0.8
    assert md.diff == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def test_out_of_range_values_in_the_file_are_refused(tmp_path):
    path = hf_model(tmp_path / "m", {"temperature": 1e308, "top_k": 10**26, "repetition_penalty": 0,
                                     "max_new_tokens": 1e12, "top_p": 0.5})
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert [t for _, t in md.notes] == [
        "the model's repetition_penalty = 0 is not used: above 0 expected",
        "the model's temperature = 1e+308 is not used: out of range (float32)",
        "the model's top_k = 100000000000000000000000000 is not used: at most 2147483647 expected",
        "the model's max_tokens = 1000000000000.0 is not used: at most 2147483647 expected"]
    p = md.params
    assert (p.temperature, p.top_k, p.top_p, p.repeat_penalty, p.repeat_last_n, p.n_predict) == \
        (1.0, 0, 0.5, 1.0, 64, -1)
    assert md.diff == {"top_p": 0.5}
    assert ollama_layer(md) == {"top_p": 0.5}  # nothing the Ollama face would blame on the client
    path = hf_model(tmp_path / "n", {"temperature": -1, "repetition_penalty": -1, "max_new_tokens": 10**20,
                                     "top_k": -5})
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert [t for _, t in md.notes] == [
        "the model's repetition_penalty = -1 is not used: above 0 expected",
        "the model's temperature = -1 is not used: at least 0 expected",
        "the model's top_k = -5 is not used: -1 or 0 (off) or at least 1 expected",
        "the model's max_tokens = 100000000000000000000 is not used: at most 2147483647 expected"]
    assert (md.params, md.diff, md.log_line()) == (parse_args([], environ={}).default_sampling_params(), {}, None)


def test_a_file_of_refused_values_keeps_llama_servers_defaults_and_prints_nothing(serve, tmp_path):
    path = hf_model(tmp_path / "m", {"temperature": "hot", "top_k": {"a": 1}, "top_p": float("nan")})
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert md.params == parse_args([], environ={}).default_sampling_params()
    assert (md.diff, md.log_line()) == ({}, None)
    path = hf_model(tmp_path / "n", {"temperature": "hot", "top_k": 5})
    md = model_defaults(parse_args(["-m", str(path)], environ={}), str(path))
    assert md.log_line() == ("Default kvserve sampling parameters have been overridden by the model's "
                             "`generation_config.json`: `{'top_k': 5}`. If this is not intended, please relaunch "
                             "kvserve with `--generation-config vllm`.")


def test_generation_config_vllm_given_runs_with_vllms_neutral_values(hf14, tiny_gguf):
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}

    def five(p):
        return {k: getattr(p, k) for k in neutral}
    md = model_defaults(parse_args(["-m", str(hf14), "--generation-config", "vllm"], environ={}), str(hf14))
    assert (five(md.params), md.diff, md.log_line()) == (neutral, {}, None)
    md = model_defaults(parse_args(["--generation-config", "vllm", "--top-k", "7"], environ={}), str(tiny_gguf))
    assert five(md.params) == {**neutral, "top_k": 7}  # a flag given keeps its value
    # the default (auto, a model without a file): llama-server's, as before
    md = model_defaults(parse_args([], environ={}), str(tiny_gguf))
    assert five(md.params) == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
