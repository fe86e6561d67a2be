"""llama-server's LoRA interface on a real ``kvserve serve`` process (tiny random model and adapters made
here): ``--lora`` / ``--lora-scaled`` / ``--lora-init-without-apply``, ``GET`` / ``POST /lora-adapters``,
the per-request ``lora`` field on /completion and /v1/chat/completions (``generation_settings`` shows
it), the prefix cache keyed by adapter, bad input in each dialect's envelope, start-up errors.
Greedy tokens are compared with the base model merged by hand (tests/tinylora.py) run in-process."""

from __future__ import annotations

import httpx
import pytest
import tinylora
import tinymodel
from servers import spawn

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.models.build import load_files

SEED = 3
PROMPT = "the cat and the dog sat on the mat in the sun"
N = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-api")
    return {
        "base": str(tinymodel.write_tiny_gguf(d / "base.gguf", seed=SEED)),
        "a1": str(tinylora.write_gguf_adapter(d / "a1.gguf", seed=1, task_name="shakespeare", prompt_prefix="Thou: ")),
        "p2": str(tinylora.write_peft_adapter(d / "p2", seed=2)),
        "big": str(tinylora.write_peft_adapter(d / "big", seed=7, rank=32)),
        "other": str(tinylora.write_peft_adapter(d / "other", seed=1, n_embd=32, n_head=2, n_head_kv=1)),
        "merged1": str(tinylora.write_merged_hf_dir(d / "m1", [(dict(seed=1), 1.0)], seed=SEED)),
        "merged2": str(tinylora.write_merged_hf_dir(d / "m2", [(dict(seed=2), 1.0)], seed=SEED)),
        "merged1_2h": str(tinylora.write_merged_hf_dir(d / "m12", [(dict(seed=1), 1.0), (dict(seed=2), 0.5)],
                                                       seed=SEED)),
        "logs": d,
    }


@pytest.fixture(scope="module")
def server(files):
    srv = spawn(files["base"], ("-c", "1024", "-np", "4", "--slots", "--lora", files["a1"],
                                "--lora-scaled", files["p2"], "0.5"), files["logs"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def prompt_ids(server):
    r = httpx.post(server.url("/tokenize"), json={"content": PROMPT})
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def expect(files, prompt_ids):
    """Greedy token ids of each reference model (in-process, the same engine)."""
    out = {}
    for key in ("base", "merged1", "merged2", "merged1_2h"):
        core = EngineCore(load_files(files[key]), EngineConfig(n_ctx=512, dtype="float32"))
        r = Request(key, list(prompt_ids), SamplingParams(n_predict=N, temperature=0.0))
        core.add_request(r)
        toks: list[int] = []
        done = False
        while not done:
            for o in core.step():
                toks += o.new_token_ids
                done = done or o.finished
        out[key] = toks
    assert len({tuple(v) for v in out.values()}) == 4  # every adapter changes the continuation
    return out


def complete(server, **body):
    body = {"prompt": PROMPT, "n_predict": N, "temperature": 0, "return_tokens": True, **body}
    return httpx.post(server.url("/completion"), json=body, timeout=60)


def test_get_lora_adapters_lists_the_flags(server, files):
    r = httpx.get(server.url("/lora-adapters"))
    assert r.status_code == 200
    assert r.json() == [
        {"id": 0, "path": files["a1"], "scale": 1.0, "task_name": "shakespeare", "prompt_prefix": "Thou: "},
        {"id": 1, "path": files["p2"], "scale": 0.5, "task_name": "", "prompt_prefix": ""},
    ]


def test_per_request_lora_overrides_global_scales(server, expect):
    r = complete(server, lora=[{"id": 0, "scale": 1.0}])
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expect["merged1"]
    assert r.json()["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
    r = complete(server, lora=[{"id": 1, "scale": 1}])  # id 0 not listed: scale 0 for this request
    assert r.json()["tokens"] == expect["merged2"]
    r = complete(server, lora=[{"id": 0, "scale": 0.0}])
    assert r.json()["tokens"] == expect["base"]
    assert r.json()["generation_settings"]["lora"] == []
    for body in ({}, {"lora": []}, {"lora": None}):  # absent or empty: the global scales
        r = complete(server, **body)
        assert r.json()["tokens"] == expect["merged1_2h"]
        assert r.json()["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]


def test_post_lora_adapters_sets_global_scales(server, expect):
    try:
        r = httpx.post(server.url("/lora-adapters"), json=[{"id": 1, "scale": 1.0}])
        assert r.status_code == 200 and r.json() == {"success": True}
        assert [(a["id"], a["scale"]) for a in httpx.get(server.url("/lora-adapters")).json()] == [(0, 0.0), (1, 1.0)]
        assert complete(server).json()["tokens"] == expect["merged2"]
        assert complete(server, lora=[{"id": 0, "scale": 1}]).json()["tokens"] == expect["merged1"]
    finally:
        httpx.post(server.url("/lora-adapters"), json=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}])
    assert complete(server).json()["tokens"] == expect["merged1_2h"]


def test_chat_completions_lora_field(server):
    msgs = [{"role": "user", "content": PROMPT}]
    rendered = httpx.post(server.url("/apply-template"), json={"messages": msgs}).json()["prompt"]
    for lora in ([{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 0.7}], [{"id": 0, "scale": 0}]):
        chat = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                          json={"messages": msgs, "max_tokens": N, "temperature": 0, "lora": lora})
        assert chat.status_code == 200, chat.text
        plain = complete(server, prompt=rendered, lora=lora)
        assert chat.json()["choices"][0]["message"]["content"] == plain.json()["content"]
    a = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json={"messages": msgs, "max_tokens": N, "temperature": 0, "lora": [{"id": 0, "scale": 1}]})
    b = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json={"messages": msgs, "max_tokens": N, "temperature": 0, "lora": [{"id": 0, "scale": 0}]})
    assert a.json()["choices"][0]["message"]["content"] != b.json()["choices"][0]["message"]["content"]


def test_prefix_cache_not_shared_across_adapters(server):
    prompt = "a long prompt that is only used by the prefix cache test, once per adapter and scale " * 3

    def cache_n(lora):
        r = complete(server, prompt=prompt, n_predict=2, lora=lora)
        assert r.status_code == 200, r.text
        return r.json()["timings"]["cache_n"], r.json()["tokens_evaluated"]

    n0, total = cache_n([{"id": 0, "scale": 1.0}])
    assert n0 == 0
    assert cache_n([{"id": 0, "scale": 1.0}]) == (total - 1, total)  # the same adapter: the full prefix
    assert cache_n([{"id": 1, "scale": 1.0}])[0] == 0  # another adapter: nothing
    assert cache_n([{"id": 0, "scale": 0.25}])[0] == 0  # another scale: nothing
    assert cache_n([{"id": 0, "scale": 0.0}])[0] == 0  # the base: nothing
    assert cache_n([{"id": 0, "scale": 1.0}])[0] == total - 1


@pytest.mark.parametrize("lora,msg", [
    ([{"id": 7, "scale": 1.0}], "invalid adapter id 7: no LoRA adapter has it (loaded: [0, 1])"),
    ([{"id": 0, "scale": 1e308}], "LoRA scale must be a finite number in [-1000, 1000], got 1e+308"),
    ([{"id": 0, "scale": 1.0}, {"id": 0, "scale": 0.5}], "LoRA adapter id 0 is listed twice"),
    ({"id": 0}, "Error: 'lora' must be an array of objects with 'id' and 'scale' fields"),
    ([{"id": "0", "scale": 1}], "Error: 'lora' must be an array of objects with 'id' and 'scale' fields: 'id' must "
                                "be an integer, got \"0\""),
    ([{"id": 0, "scale": "1"}], "Error: 'lora' must be an array of objects with 'id' and 'scale' fields: 'scale' "
                                "must be a number, got \"1\""),
])
def test_bad_lora_field_is_400_in_each_envelope(server, expect, lora, msg):
    r = complete(server, lora=lora)
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": msg, "type": "invalid_request_error"}}
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": lora})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == msg and err["type"] == "invalid_request_error" and err["code"] == 400
    assert complete(server).json()["tokens"] == expect["merged1_2h"]  # the server goes on


def test_nan_scale_refused(server):
    body = '{"prompt": "hi", "n_predict": 2, "lora": [{"id": 0, "scale": NaN}]}'
    r = httpx.post(server.url("/completion"), content=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "LoRA scale must be a finite number in [-1000, 1000], got nan"
    r = httpx.post(server.url("/lora-adapters"), content='[{"id": 0, "scale": NaN}]')
    assert r.status_code == 400
    assert [a["scale"] for a in httpx.get(server.url("/lora-adapters")).json()] == [1.0, 0.5]  # unchanged


@pytest.mark.parametrize("body,msg", [
    ('{"id": 0, "scale": 1}', "Request body must be an array"),
    ('[{"id": 5, "scale": 1}]', "invalid adapter id 5: no LoRA adapter has it"),
    ('[{"id": 0, "scale": 1e308}]', "LoRA scale must be a finite number in [-1000, 1000], got 1e+308"),
])
def test_bad_post_lora_adapters(server, body, msg):
    r = httpx.post(server.url("/lora-adapters"), content=body)
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": msg, "type": "invalid_request_error"}}
    assert [a["scale"] for a in httpx.get(server.url("/lora-adapters")).json()] == [1.0, 0.5]


def test_init_without_apply(files, expect):
    srv = spawn(files["base"], ("-c", "512", "--lora", f"{files['a1']},{files['p2']}", "--lora-init-without-apply"),
                files["logs"])
    try:
        srv.wait_ready()
        assert [(a["id"], a["scale"]) for a in httpx.get(srv.url("/lora-adapters")).json()] == [(0, 0.0), (1, 0.0)]
        assert complete(srv).json()["tokens"] == expect["base"]
        assert complete(srv, lora=[{"id": 1, "scale": 1}]).json()["tokens"] == expect["merged2"]
    finally:
        srv.stop()


@pytest.mark.parametrize("key,flags,msg", [
    ("missing", (), "LoRA adapter not found: /nonexistent/lora.gguf"),
    ("big", ("--max-lora-rank", "16"), "rank 32 is greater than --max-lora-rank 16"),
    ("other", (), "blk.0.ffn_down has shape [32, 128] (B rows x A columns), the base model's is [64, 128]"),
])
def test_startup_errors_name_the_file(files, key, flags, msg):
    path = files.get(key, "/nonexistent/lora.gguf")
    srv = spawn(files["base"], ("-c", "512", "--lora", path, *flags), files["logs"])
    try:
        rc = srv.proc.wait(timeout=120)
    finally:
        srv.stop()
    assert rc != 0
    log = srv.log()
    assert msg in log and path in log
    assert "Traceback" not in log
