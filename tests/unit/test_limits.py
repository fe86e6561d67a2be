"""Caps on every list and text a client sends (issue 31, kvserve.faces.limits): each over-cap request is a
400 naming the field and the cap, refused before the work it would have caused."""

from __future__ import annotations

import asyncio
import resource
import time

import httpx
import pytest

from kvserve.app import build_app
from kvserve.chat.prompt import MAX_CONTENT_PARTS, MAX_MESSAGES, normalize_messages
from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidInputError
from kvserve.faces.chat_features import parse_tools
from kvserve.faces.api_error import ApiError
from kvserve.faces.limits import check_input_bytes
from kvserve.faces.params import sampling_params_from_body
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState


def _refused(body: dict) -> str:
    with pytest.raises(ApiError) as e:
        sampling_params_from_body(body, SamplingParams(), None)
    assert e.value.status == 400
    return e.value.message


def test_samplers_and_stop_are_capped():
    """The attack run's 10**6 samplers took 50 s and delayed others' chats by 36 s."""
    t0 = time.monotonic()
    assert _refused({"samplers": ["top_k"] * 10 ** 6}) == \
        "Field 'samplers': at most 64 samplers per request, got 1000000"
    assert _refused({"samplers": "k" * 65}) == "Field 'samplers': at most 64 samplers per request, got 65"
    assert time.monotonic() - t0 < 5  # the body scan for lone surrogates; no sampler chain of 10**6
    assert _refused({"stop": ["x"] * 65}) == "Field 'stop': at most 64 stop strings per request, got 65"
    assert _refused({"stop": "x" * 1001}) == "Field 'stop': each stop string has at most 1000 characters"
    p = sampling_params_from_body({"stop": ["a"] * 64, "samplers": ["top_k", "temperature"]}, SamplingParams(), None)
    assert (len(p.stop), p.samplers) == (64, ("top_k", "temperature"))


def test_tools_messages_and_parts_are_capped():
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ApiError) as e:
        parse_tools([tool] * 513)
    assert (e.value.status, e.value.message) == (400, "Field 'tools': at most 512 tools per request, got 513")
    assert len(parse_tools([tool] * 512)) == 512
    msg = {"role": "user", "content": "hi"}
    with pytest.raises(InvalidInputError) as e:
        normalize_messages([msg] * (MAX_MESSAGES + 1))
    assert e.value.message == f"'messages': at most {MAX_MESSAGES} messages per request, got {MAX_MESSAGES + 1}"
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    with pytest.raises(InvalidInputError) as e:
        normalize_messages([{"role": "user", "content": parts}])
    assert e.value.message == (f"messages[0].content: at most {MAX_CONTENT_PARTS} parts per message, "
                                f"got {MAX_CONTENT_PARTS + 1}")
    assert normalize_messages([{"role": "user", "content": parts[:3]}])[0]["content"] == "a\na\na"


def test_input_bytes_count_utf8_bytes_not_characters():
    check_input_bytes("input", ["é" * 5, [1, 2, 3]], 10)  # 10 bytes: fits
    with pytest.raises(ApiError) as e:
        check_input_bytes("input", ["é" * 5, "x"], 10)
    assert e.value.message == "Field 'input': the text is larger than 10 bytes (--max-input-bytes raises the cap)"
    with pytest.raises(ApiError):
        check_input_bytes("input", ["x" * 11], 10)


def test_flags_raise_the_caps():
    a = parse_args(["--max-batch-inputs", "5000", "--max-input-bytes", "64M"])
    assert (a.max_batch_inputs, a.max_input_bytes) == (5000, 64 << 20)
    a = parse_args([], environ={"KVSERVE_MAX_BATCH_INPUTS": "7", "KVSERVE_MAX_INPUT_BYTES": "1k"})
    assert (a.max_batch_inputs, a.max_input_bytes) == (7, 1000)
    d = parse_args([], environ={})
    assert (d.max_batch_inputs, d.max_input_bytes) == (2048, 2 << 20)


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("field", ["content", "prompt"])
def test_a_30_mb_tokenize_is_refused_in_under_2_s(field):
    """The attack run's repro: a 30 MB /tokenize took 21.5 s and +4.2 GB RSS."""
    state = ServerState(parse_args([]))
    state.preloading = True  # no model: the text is refused before one is asked for
    app = build_app(state)
    body = ('{"%s": "' % field + "word " * (6 << 20) + '"}').encode()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.monotonic()
    r = _call(app, "POST", "/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert time.monotonic() - t0 < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before < 500
    assert r.status_code == 400
    assert r.json()["error"]["message"] == \
        f"Field '{field}': the text is larger than {2 << 20} bytes (--max-input-bytes raises the cap)"


def test_detokenize_ids_are_capped_before_any_model():
    """Review 5: 10 M ids made a 200 MB answer and +1.1 GB RSS. /detokenize takes at most one id per byte of
    --max-input-bytes (the most /tokenize returns for a text it accepts)."""
    state = ServerState(parse_args(["--max-input-bytes", "1k"]))
    state.preloading = True  # no model: refused before one is asked for
    app = build_app(state)
    r = _call(app, "POST", "/detokenize", json={"tokens": [1] * 1001})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "Field 'tokens': at most 1000 token ids per request, got 1001 (--max-input-bytes raises the cap)")
    assert _call(app, "POST", "/detokenize", json={"tokens": [1] * 1000}).status_code == 503  # the cap passed
    big = ("{\"tokens\": [" + "1," * (2 << 20) + "1]}").encode()
    t0 = time.monotonic()
    r = _call(build_app(ServerState(parse_args([]))), "POST", "/detokenize", content=big,
              headers={"Content-Type": "application/json"})
    assert time.monotonic() - t0 < 10
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, f"Field 'tokens': at most {2 << 20} token ids per request, got {(2 << 20) + 1} "
             "(--max-input-bytes raises the cap)")
