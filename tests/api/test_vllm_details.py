"""vLLM's request and response details on the OpenAI and native faces: ``prompt_logprobs``,
``truncate_prompt_tokens``, ``/v1/models`` fields, ``/tokenize`` and ``/detokenize`` in vLLM's
shape, ``/version``, ``/ping``, and fill-in-the-middle (``suffix`` on ``/v1/completions``,
llama-server's ``/infill``) with a vocabulary that has FIM tokens and one that has none.

Tiny random-weight models served in process (Starlette's TestClient)."""

from __future__ import annotations

import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
from servers import app_client

import kvserve

QWEN_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
NO_FIM = "prefix token is missing. suffix token is missing. middle token is missing. "


_client = app_client


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_details")
    path = tinymodel.write_tiny_gguf(d / "tiny.gguf")
    c = _client(path, d)
    c.model_path = str(path)
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


@pytest.fixture(scope="module")
def fim(tmp_path_factory):
    """The tiny model with Qwen's FIM tokens (prefix, middle, suffix, pad, repo, file separator)."""
    d = tmp_path_factory.mktemp("vllm_fim")
    mp = pytest.MonkeyPatch()
    mp.setattr(tinymodel, "SPECIAL_TOKENS", tinymodel.SPECIAL_TOKENS + QWEN_FIM)
    try:
        path = tinymodel.write_tiny_gguf(d / "fim.gguf")
    finally:
        mp.undo()
    c = _client(path, d, "-b", "64")  # llama-server's FIM budgets follow the batch size
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


def ids_of(c, text: str, parse_special: bool = True) -> list[int]:
    return c.post("/tokenize", json={"content": text, "parse_special": parse_special}).json()["tokens"]


def text_of(c, ids: list[int]) -> str:
    return c.post("/detokenize", json={"tokens": ids}).json()["content"]


def error(r) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["message"]


# -- prompt_logprobs ----------------------------------------------------------------------------

def test_prompt_logprobs_on_completions_shape_counts_and_values(tiny):
    prompt = "hello world"
    ids = ids_of(tiny, prompt)
    pieces = [p["piece"] for p in tiny.post("/tokenize", json={"content": prompt, "with_pieces": True}).json()["tokens"]]
    r = tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) == len(plp)
    assert plp[0] is None  # nothing predicts the first token
    for i, entry in enumerate(plp[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(ids[i])  # the prompt token first
        assert entry[keys[0]]["decoded_token"] == pieces[i]
        top = [entry[k] for k in keys[1:]]
        if len(keys) == 2:  # the prompt token is one of the two most likely
            rank = entry[keys[0]]["rank"]
            assert rank in (1, 2)
            assert len([v for v in [entry[keys[0]], *top] if v["rank"] != rank]) == 1
        else:
            assert len(keys) == 3 and [t["rank"] for t in top] == [1, 2]
            assert entry[keys[0]]["rank"] is None  # outside the reported candidates
            assert top[0]["logprob"] >= top[1]["logprob"] >= entry[keys[0]]["logprob"]
    # the same numbers as the legacy echo + logprobs path
    legacy = tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
                                                "logprobs": 2}).json()["choices"][0]["logprobs"]
    for i in range(1, len(ids)):
        assert plp[i][str(ids[i])]["logprob"] == pytest.approx(legacy["token_logprobs"][i], abs=1e-5)


def test_prompt_logprobs_on_chat_is_top_level_and_zero_gives_the_prompt_token_only(tiny):
    r = tiny.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    plp = d["prompt_logprobs"]
    assert len(plp) == d["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in plp[1:])
    assert "prompt_logprobs" not in d["choices"][0]
    plain = tiny.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain  # only when asked for


@pytest.mark.parametrize(("extra", "want"), [
    ({"stream": True, "prompt_logprobs": 1}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"stream": True, "prompt_logprobs": -1}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": -1}, "Requested prompt logprobs of 301, which is greater than max allowed: 20"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_refusals(tiny, path, extra, want):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert error(tiny.post(path, json={**body, "max_tokens": 1, **extra})) == (400, want)


def test_prompt_logprobs_zero_with_a_stream_is_accepted(tiny):
    r = tiny.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True, "prompt_logprobs": 0})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


# -- truncate_prompt_tokens -----------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    prompt = "one two three four five six seven"
    ids = ids_of(tiny, prompt)
    r = tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True,
                                           "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"].startswith(text_of(tiny, ids[-3:]))
    r = tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)  # -1: max_model_len, which it fits
    r = tiny.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
                                                "truncate_prompt_tokens": 5}).json()
    assert r["usage"]["prompt_tokens"] == 5
    assert error(tiny.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 257})) == (
        400, ("truncate_prompt_tokens value (257) is greater than max_model_len (256). "
              "Please, select a smaller truncation size."))
    assert error(tiny.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": -2})) == (
        400, "Field 'truncate_prompt_tokens': must be >= -1")


# -- /v1/models, /tokenize, /detokenize, /version, /ping ------------------------------------------

def test_models_entries_have_vllm_fields(tiny):
    entry = tiny.get("/v1/models").json()["data"][0]
    assert (entry["id"], entry["max_model_len"], entry["root"], entry["parent"]) == ("tiny", 256, tiny.model_path,
                                                                                    None)
    perm = entry["permission"][0]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert (perm["allow_sampling"], perm["allow_logprobs"], perm["organization"]) == (True, True, "*")
    one = tiny.get("/v1/models/tiny").json()
    assert (one["max_model_len"], one["root"], one["parent"]) == (256, tiny.model_path, None)


def test_tokenize_in_vllms_shape(tiny):
    ids = ids_of(tiny, "hello world")
    assert tiny.post("/tokenize", json={"content": "hello world"}).json() == {"tokens": ids}  # llama-server's
    assert tiny.post("/tokenize", json={"model": "tiny", "prompt": "hello world"}).json() == {
        "count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    vocab = tinymodel.tiny_vocab()[0]
    d = tiny.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True,
                                     "add_special_tokens": False}).json()
    assert d["token_strs"] == [vocab[i] for i in ids] and d["count"] == len(ids)
    msgs = [{"role": "user", "content": "hi"}]
    rendered = tiny.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    chat = tiny.post("/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == ids_of(tiny, rendered) and chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] == 256
    bare = tiny.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]


def test_detokenize_answers_both_names(tiny):
    ids = ids_of(tiny, "hello world")
    assert tiny.post("/detokenize", json={"model": "tiny", "tokens": ids}).json() == {
        "content": "hello world", "prompt": "hello world"}


def test_version_and_ping(tiny):
    assert tiny.get("/version").json() == {"version": kvserve.__version__}
    for r in (tiny.get("/ping"), tiny.post("/ping")):
        assert (r.status_code, r.content) == (200, b"")


# -- fill in the middle ---------------------------------------------------------------------------

def _fim_ids(c) -> dict[str, int]:
    return {t: ids_of(c, t)[0] for t in QWEN_FIM}


def test_infill_lays_out_llama_servers_fim_prompt(fim):
    t = _fim_ids(fim)

    def enc(s):
        return ids_of(fim, s, parse_special=False)

    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n", "prompt": "c =",
            "input_extra": [{"filename": "util.py", "text": "x = 1\n"}], "n_predict": 2, "temperature": 0}
    r = fim.post("/infill", json=body)
    assert r.status_code == 200, r.text
    want = ([t["<|repo_name|>"]] + enc("myproject\n") + [t["<|file_sep|>"]] + enc("util.py\n") + enc("x = 1\n")
            + [t["<|file_sep|>"]] + enc("filename\n") + [t["<|fim_prefix|>"]] + enc(body["input_prefix"])
            + enc(body["prompt"]) + [t["<|fim_suffix|>"]] + enc(body["input_suffix"]) + [t["<|fim_middle|>"]])
    d = r.json()
    assert d["tokens_evaluated"] == len(want) and d["prompt"] == text_of(fim, want)
    assert d["tokens_predicted"] <= 2 and d["stop"] is True
    # the suffix keeps its first n_batch/4 - 2 - len(prompt) tokens (-b 64: 16 - 2 - 2 = 12)
    long_suffix = " ".join(["word"] * 40)
    d = fim.post("/infill", json={**body, "input_suffix": long_suffix, "input_extra": []}).json()
    cut = enc(long_suffix)[:16 - 2 - len(enc("c ="))]
    assert d["prompt"].endswith(text_of(fim, [t["<|fim_suffix|>"]] + cut + [t["<|fim_middle|>"]]))
    assert error(fim.post("/infill", json={"input_prefix": "a"})) == (400, '"input_suffix" is required')
    assert error(fim.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "input_extra": [{"x": 1}]})) == (
        400, 'extra_context chunk must contain a "text" field with a string value')


def test_suffix_on_completions_is_fim(fim):
    t = _fim_ids(fim)

    def enc(s):
        return ids_of(fim, s, parse_special=False)

    r = fim.post("/v1/completions", json={"prompt": "def f():\n    return", "suffix": "\n\nprint(f())\n",
                                          "max_tokens": 1, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    want = ([t["<|repo_name|>"]] + enc("myproject\n") + [t["<|file_sep|>"]] + enc("filename\n")
            + [t["<|fim_prefix|>"]] + enc("def f():\n    return") + [t["<|fim_suffix|>"]] + enc("\n\nprint(f())\n")
            + [t["<|fim_middle|>"]])
    d = r.json()
    assert d["usage"]["prompt_tokens"] == len(want)
    assert d["choices"][0]["text"].startswith(text_of(fim, want))


def test_a_vocabulary_without_fim_tokens_says_why(tiny):
    assert error(tiny.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})) == (
        501, "Infill is not supported by this model: " + NO_FIM)
    assert tiny.post("/infill", json={"input_prefix": "a", "input_suffix": "b"}).json()["error"]["type"] == \
        "not_supported_error"
    assert error(tiny.post("/v1/completions", json={"prompt": "a", "suffix": "b"})) == (
        400, "'suffix' is not supported by this model: " + NO_FIM.rstrip())
    # an empty suffix is no suffix (OpenAI's default)
    assert tiny.post("/v1/completions", json={"prompt": "a", "suffix": "", "max_tokens": 1}).status_code == 200


# -- a request's own chat_template (vLLM: refused unless --trust-request-chat-template) ------------

_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")
_UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
              "Refused request with untrusted chat template.")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_request_chat_template_is_refused_without_trust(tiny, path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": _TEMPLATE}
    assert error(tiny.post(path, json=body)) == (400, _UNTRUSTED)


def test_a_trusted_request_chat_template_renders_chat_and_tokenize(tmp_path):
    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf")
    c = _client(path, tmp_path, "--trust-request-chat-template")
    try:
        msgs = [{"role": "user", "content": "hi"}]
        want = ids_of(c, "[user]hi[assistant]")
        tok = c.post("/tokenize", json={"messages": msgs, "chat_template": _TEMPLATE}).json()
        assert tok["tokens"] == want
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "chat_template": _TEMPLATE})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        bad = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "chat_template": "{% if %}"})
        assert bad.status_code == 400
        assert bad.json()["error"]["message"].startswith("chat_template: chat template syntax error at line 1")
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)
