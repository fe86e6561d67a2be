"""Three vLLM serving flags with their effect (issue #15): ``--return-tokens-as-token-ids``
(logprobs tokens as ``token_id:N``, per request ``return_tokens_as_token_ids``),
``--enable-force-include-usage`` (every stream ends with a usage chunk) and ``--response-role``
(the answer's role when the prompt ends with the generation prompt; else the last message's).

Tiny random-weight models served in process (Starlette's TestClient)."""

from __future__ import annotations

import json

import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
from servers import app_client

from kvserve.serving.args import parse_args

MSGS = [{"role": "user", "content": "hello there"}]


_client = app_client


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_flags")
    return tinymodel.write_tiny_gguf(d / "tiny.gguf"), d


@pytest.fixture(scope="module")
def plain(paths):
    c = _client(*paths)
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


@pytest.fixture(scope="module")
def flagged(paths):
    c = _client(*paths, "--return-tokens-as-token-ids", "--enable-force-include-usage", "--response-role", "robot")
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    out = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def _tokenizer(c):
    return c.state.peek(None).tokenizer


def _ids(c, text: str) -> list[int]:
    return c.post("/tokenize", json={"content": text}).json()["tokens"]


# -- --return-tokens-as-token-ids -----------------------------------------------------------------

def test_chat_logprobs_tokens_are_the_real_ids(plain, flagged):
    body = {"messages": MSGS, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": True}
    base = plain.post("/v1/chat/completions", json={**body, "return_tokens": True}).json()["choices"][0]
    got = flagged.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert got["message"]["content"] == base["message"]["content"]  # same model, same greedy text
    ids = [e["token"] for e in got["logprobs"]["content"]]
    real = [int(t.removeprefix("token_id:")) for t in ids]
    assert ids == [f"token_id:{t}" for t in real] and len(ids) == 4
    # the ids are the generated tokens: their bytes are the entries' bytes, together the answer's text
    tok = _tokenizer(flagged)
    assert [list(tok.token_bytes(t)) for t in real] == [e["bytes"] for e in base["logprobs"]["content"]]
    assert flagged.post("/detokenize", json={"tokens": real}).json()["content"] == base["message"]["content"]
    for g, b in zip(got["logprobs"]["content"], base["logprobs"]["content"]):
        assert (g["logprob"], g["bytes"]) == (b["logprob"], b["bytes"])  # vLLM: the sampled token's text bytes
        assert [t["logprob"] for t in g["top_logprobs"]] == [t["logprob"] for t in b["top_logprobs"]]
        for t in g["top_logprobs"]:
            assert t["token"].startswith("token_id:") and t["bytes"] == list(t["token"].encode())
    # the request field turns it off (and on) per request
    off = flagged.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    # (a cached prompt's logprobs differ in the last float bits: compare the tokens and bytes)
    def shape(lps):
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in lps["content"]]

    assert shape(off["choices"][0]["logprobs"]) == shape(base["logprobs"])
    on = plain.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    assert on["choices"][0]["logprobs"]["content"][0]["token"] == ids[0]


def test_completion_logprobs_tokens_offsets_and_stream(plain, flagged):
    body = {"prompt": "one two", "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    base = plain.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    got = flagged.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    real = [int(t.removeprefix("token_id:")) for t in got["tokens"]]
    assert got["tokens"] == [f"token_id:{t}" for t in real] and len(real) == 4
    tok = _tokenizer(flagged)
    assert "".join(tok.token_bytes(t).decode("utf-8", "replace") for t in real) == "".join(base["tokens"])
    assert got["token_logprobs"] == base["token_logprobs"]
    # vLLM's text_offset counts the token_id:N strings
    offs, acc = [], 0
    for tok in got["tokens"]:
        offs.append(acc)
        acc += len(tok)
    assert got["text_offset"] == offs
    for top in got["top_logprobs"]:
        assert all(k.startswith("token_id:") for k in top)
    # streamed chunks carry the same tokens
    ev = _events(flagged.post("/v1/completions", json={**body, "stream": True}))
    streamed = [t for e in ev for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    assert streamed == got["tokens"]
    # echo: the prompt's tokens too
    echo = flagged.post("/v1/completions", json={**body, "echo": True, "max_tokens": 1}).json()
    prompt_ids = _ids(flagged, "one two")
    assert echo["choices"][0]["logprobs"]["tokens"][:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]


# -- --enable-force-include-usage -----------------------------------------------------------------

def test_force_include_usage_adds_the_usage_chunk(plain, flagged):
    body = {"messages": MSGS, "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    ev = _events(plain.post("/v1/chat/completions", json=body))
    assert all("usage" not in e for e in ev)
    ev = _events(flagged.post("/v1/chat/completions", json=body))
    last = ev[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3
    assert sum("usage" in e for e in ev) == 1
    # stream_options.include_usage false does not turn it off (vLLM's should_include_usage)
    ev = _events(flagged.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": False}}))
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 3
    ev = _events(flagged.post("/v1/completions", json={"prompt": "one two", "max_tokens": 2, "temperature": 0,
                                                       "stream": True, "ignore_eos": True}))
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 2
    ev = _events(plain.post("/v1/completions", json={"prompt": "one two", "max_tokens": 2, "stream": True}))
    assert all("usage" not in e for e in ev)


# -- --response-role -------------------------------------------------------------------------------

def test_response_role(plain, flagged):
    body = {"messages": MSGS, "max_tokens": 2, "temperature": 0}
    assert plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "assistant"
    assert flagged.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "robot"
    ev = _events(flagged.post("/v1/chat/completions", json={**body, "stream": True}))
    assert ev[0]["choices"][0]["delta"] == {"role": "robot", "content": None}
    assert all("role" not in e["choices"][0]["delta"] for e in ev[1:] if e["choices"])
    # continuing the last message (no generation prompt): its role, as vLLM's get_chat_request_role
    cont = {"messages": MSGS + [{"role": "assistant", "content": "Sure"}], "max_tokens": 2, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    assert flagged.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "assistant"
    assert parse_args(["--response-role", "robot"]).response_role == "robot"
