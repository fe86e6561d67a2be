"""The Anthropic face without a model: the request translation (:func:`chat_request`: kvserve's
typed chat request), the error envelope for model-manager errors, and the stream writer's error
event."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.errors import NotFoundError, UnavailableError
from kvserve.faces.anthropic import _sse, chat_request, error_envelope
from kvserve.faces.api_error import ApiError
from kvserve.serving.args import parse_args
from kvserve.serving.chat_request import ReasoningOptions, TemplateOptions
from kvserve.serving.state import ServerState


def test_chat_request_translates_every_block_kind():
    body = {
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        "messages": [
            {"role": "user", "content": "Read it."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}},
                {"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "B"}],
                 "is_error": True},
                {"type": "text", "text": "Now?", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}},
                  {"type": "custom", "name": "ls", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "read", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
        "thinking": {"type": "enabled", "budget_tokens": 20}, "metadata": {"user_id": "u"},
        "output_config": {"effort": "low"},
    }
    req = chat_request(body)
    assert req.messages == [
            {"role": "system", "content": "S1\nS2"},
            {"role": "user", "content": "Read it."},
            {"role": "assistant", "content": "Reading.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": {"path": "a"}}},
                {"id": "toolu_2", "type": "function", "function": {"name": "ls", "arguments": {}}}],
             "reasoning_content": "hmm"},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "A"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "B"},
            {"role": "user", "content": "Now?"}]
    assert req.tools == [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                                           "parameters": {"type": "object"}}},
                         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    assert (req.tool_choice, req.parallel_tool_calls) == ({"name": "read"}, False)
    # max_tokens is a cap: n_predict the engine may lower to the context's room
    assert (req.sampling, req.n_predict_is_default) == (
        {"n_predict": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "stop": ("END",)}, True)
    assert req.template == TemplateOptions(variables={"enable_thinking": True})
    assert req.reasoning == ReasoningOptions(budget=20, effort="low")
    assert (req.response_format, req.model, req.id_slot, req.cache_salt) == (None, "m", -1, None)


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
])
def test_tool_choice_names(choice, expected):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
            "tools": [{"name": "t", "input_schema": {"type": "object"}}]}
    assert chat_request(body).tool_choice == expected


@pytest.mark.parametrize(("choice", "shown"), [({"type": "auto"}, "'auto'"), ({"type": "any"}, "'required'")])
def test_tool_choice_without_tools_keeps_the_chat_paths_text(choice, shown):
    """As when this face built a chat-completions body: auto / any without tools is a 400 in that
    path's words (kept as it was; Anthropic's own answer may differ)."""
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
    with pytest.raises(ApiError) as e:
        chat_request(body)
    assert (e.value.status, e.value.message) == (400, f"Field 'tool_choice': {shown} requires 'tools'")
    assert chat_request({**body, "tool_choice": {"type": "none"}}).tool_choice == "none"


def test_count_tokens_body_needs_no_max_tokens_and_drops_sampling():
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 1, "stop_sequences": ["a"],
            "thinking": {"type": "disabled"}, "output_config": {"format": {"type": "json_schema",
                                                                          "schema": {"type": "object"}}}}
    req = chat_request(body, counting=True)
    assert req.messages == [{"role": "user", "content": "x"}]
    assert (req.sampling, req.n_predict_is_default) == ({"n_predict": 1}, False)
    assert req.template.variables == {"enable_thinking": False}
    assert (req.response_format.kind, req.response_format.value) == ("json_schema", '{"type":"object"}')


def test_tool_choice_type_of_any_json_value_is_a_400():
    for typ in ({"a": 1}, ["any"], 3, None):
        body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": typ}}
        with pytest.raises(ApiError) as e:
            chat_request(body)
        assert (e.value.status, e.value.message) == (400, "tool_choice.type: Input should be 'auto', 'any', "
                                                          "'tool' or 'none'")


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": []}, "max_tokens: Field required"),
    ({"max_tokens": True, "messages": []}, "max_tokens: Input should be a valid integer, got a boolean"),
    ({"max_tokens": 5, "messages": "hi"}, "messages: Input should be a valid list, got a string"),
    ({"max_tokens": 5, "messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0: content block type 'tool_result' is not supported here"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                  "content": [{"type": "document"}]}]}]},
     "messages.0.content.0.content.0: only text blocks are supported here, got 'document'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]},
     "tools.0.input_schema: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
     "thinking.enabled.budget_tokens: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences.0: Input should be a non-empty string"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["s"] * 65},
     "stop_sequences: at most 64 sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{}] * 513},
     "tools: at most 512 tools"),
    # review #16: what was accepted, or named an internal field
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope",
                                                                  "content": "x"}]}]},
     "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: nope. Each `tool_result` "
     "block must have a corresponding `tool_use` block in an earlier message."),
    ({"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"},
                                     {"type": "tool_result", "tool_use_id": "b", "content": "2"}]}]},
     "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: b. Each `tool_result` "
     "block must have a corresponding `tool_use` block in an earlier message."),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": -5},
     "temperature: Input should be greater than or equal to 0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1e308},
     "temperature: Input should be less than or equal to 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "temperature: Input should be a valid number, got a string"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": float("nan")},
     "temperature: Input should be a finite number"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
     "top_p: Input should be less than or equal to 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_k": -7},
     "top_k: Input should be greater than or equal to 0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_k": 2.5},
     "top_k: Input should be a valid integer, got a number with a fractional part"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]},
     "messages.0: all messages must have non-empty content except for the optional final assistant message"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": []}, {"role": "user", "content": "x"}]},
     "messages.0: all messages must have non-empty content except for the optional final assistant message"),
])
def test_bad_fields_name_the_field(body, message):
    with pytest.raises(ApiError) as e:
        chat_request(body)
    assert (e.value.status, e.value.message) == (400, message)


@pytest.mark.parametrize(("exc", "status", "etype"), [
    (NotFoundError("model 'x' not found"), 404, "not_found_error"),
    (UnavailableError("Loading model"), 503, "overloaded_error"),
    (ApiError(501, "no chat here"), 400, "invalid_request_error"),
    (ApiError(413, "too big"), 413, "request_too_large"),
    (RuntimeError("boom"), 500, "api_error"),
])
def test_error_envelope_types(exc, status, etype):
    s, body = error_envelope(exc)
    assert s == status and body["type"] == "error" and body["error"]["type"] == etype
    assert set(body["error"]) == {"type", "message"}


def test_unknown_model_is_not_found_error(tmp_path):
    state = ServerState(parse_args(["--no-preload", "--models-dir", str(tmp_path / "models")]))
    with TestClient(build_app(state), base_url="http://127.0.0.1") as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(path, json={"model": "no-such-model", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]},
                            headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == 404
            assert r.json() == {"type": "error", "error": {"type": "not_found_error",
                                                           "message": "model 'no-such-model' not found"}}


def test_stream_error_after_start_is_one_error_event():
    async def events():
        yield {"type": "message_start"}
        raise ApiError(500, "engine died")

    async def run() -> str:
        resp = await _sse(events(), ping_interval=0)
        return "".join([chunk async for chunk in resp.body_iterator])

    out = asyncio.run(run())
    assert out == ('event: message_start\ndata: {"type":"message_start"}\n\n'
                   'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"engine died"}}\n\n')


def test_stream_error_before_start_is_raised():
    async def events():
        raise ApiError(400, "bad")
        yield {}  # pragma: no cover - makes this an async generator

    with pytest.raises(ApiError):
        asyncio.run(_sse(events(), ping_interval=0))


def test_sampling_fields_in_range_pass_on():
    """temperature 0 and 1, top_k 0, an integral float top_k, a top_k beyond int64 (as large as
    any vocabulary), a huge thinking budget under a huge max_tokens (max_tokens is a cap): no
    error naming an internal field (``thinking_token_budget: integer out of range`` before)."""
    base = {"messages": [{"role": "user", "content": "x"}]}
    c = chat_request({**base, "max_tokens": 10**30, "temperature": 1, "top_p": 0, "top_k": 10**20,
                      "thinking": {"type": "enabled", "budget_tokens": 10**29}})
    assert (c.sampling["temperature"], c.sampling["top_p"], c.sampling["top_k"], c.reasoning.budget,
            c.sampling["n_predict"]) == (1.0, 0.0, 2**31 - 1, 2**31 - 1, 10**30)
    c = chat_request({**base, "max_tokens": 5, "temperature": 0, "top_k": 3.0})
    assert (c.sampling["temperature"], c.sampling["top_k"]) == (0, 3) and type(c.sampling["top_k"]) is int
    # an empty final assistant turn is allowed (Anthropic: "except for the optional final assistant message")
    c = chat_request({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]})
    assert c.messages == [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]


def test_no_ping_before_message_start():
    """Review #16: with both slots busy, the first output took longer than --sse-ping-interval
    and ``event: ping`` arrived before ``message_start``; pings now wait for the first event."""
    async def events():
        await asyncio.sleep(0.35)  # queued behind busy slots
        yield {"type": "message_start"}
        await asyncio.sleep(0.25)
        yield {"type": "message_stop"}

    async def run() -> list[str]:
        resp = await _sse(events(), ping_interval=0.1)
        return [chunk async for chunk in resp.body_iterator]

    chunks = asyncio.run(run())
    assert chunks[0] == 'event: message_start\ndata: {"type":"message_start"}\n\n'
    assert chunks[-1] == 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert set(chunks[1:-1]) == {'event: ping\ndata: {"type":"ping"}\n\n'} and 1 <= len(chunks) - 2 <= 3


def _out(**kw):
    from kvserve.engine.request import RequestOutput

    return RequestOutput(request_id="r", new_token_ids=[], text="", **kw)


@pytest.mark.parametrize(("stop_type", "truncated", "by_context", "reason"), [
    ("limit", True, True, "model_context_window_exceeded"),  # max_tokens above the room: the context ended it
    ("limit", True, False, "max_tokens"),  # max_tokens exactly the room left (was model_context_window_exceeded)
    ("limit", False, False, "max_tokens"),
    ("eos", False, True, "end_turn"),
])
def test_stop_reason_names_what_ended_the_generation(stop_type, truncated, by_context, reason):
    from kvserve.faces.anthropic import _stop

    out = _out(finished=True, stop_type=stop_type, truncated=truncated)
    assert _stop(out, False, [], by_context) == (reason, None)
