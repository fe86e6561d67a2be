"""Responses API request -> kvserve's chat request (kvserve/faces/responses.py chat_body: a Turn
whose ``chat`` is a ChatRequest, ``fields`` the extension fields read once the model is known),
without a server: input items, tools, tool_choice, text.format, reasoning, previous_response_id
and the 400/404s."""

from __future__ import annotations

import pytest

from kvserve.faces.api_error import ApiError
from kvserve.faces.responses import MAX_INPUT_ITEMS, chat_body
from kvserve.serving.chat_request import ChatRequest, StreamOptions, TemplateOptions
from kvserve.serving.chat_output import ReasoningPiece, TextPiece, ToolCallPiece
from kvserve.serving.choices import ChatEvent, ChatUsage
from kvserve.serving.response_store import ResponseStore

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": TOOL["parameters"]}}


def _chat(body: dict, store: ResponseStore | None = None, budget: int = -1) -> ChatRequest:
    return chat_body(body, store or ResponseStore(), budget).chat


def _err(body: dict, store: ResponseStore | None = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat_body(body, store or ResponseStore())
    return e.value


def test_string_input_and_instructions():
    turn = chat_body({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.2,
                      "top_p": 0.5, "top_k": 3, "seed": 9}, ResponseStore())
    c = turn.chat
    assert c.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert c.stream == StreamOptions(stream=True, include_usage=True)  # the usage comes with the last event
    assert c.template == TemplateOptions(continue_final_message=False)
    assert (c.sampling, c.n_predict_is_default, c.parallel_tool_calls, c.tools, c.tool_choice) == \
        ({"n_predict": 7}, False, True, None, "none")
    # kvserve's extension fields and the sampler values, read once the model is known
    assert turn.fields == {"top_k": 3, "seed": 9, "temperature": 0.2, "top_p": 0.5}
    assert turn.history == [{"role": "user", "content": "Hi"}]  # instructions are not carried over
    assert turn.store is True and turn.stream is False
    assert turn.echo["tool_choice"] == "auto" and turn.echo["text"] == {"format": {"type": "text"}}


def test_items_become_messages():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call_output", "call_id": "zz", "output": "orphan"},
    ]
    assert _chat({"input": items}).messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "zz", "content": "orphan"},
    ]


def test_a_call_after_a_tool_message_starts_a_new_assistant_turn():
    items = [{"role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"},
             {"type": "function_call", "call_id": "c2", "name": "f", "arguments": ""}]
    msgs = _chat({"input": items}).messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[3] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}}]}


def test_tools_tool_choice_and_format():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    turn = chat_body({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                      "parallel_tool_calls": False,
                      "text": {"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}},
                     ResponseStore())
    c = turn.chat
    assert c.tools == [CHAT_TOOL]
    assert c.tool_choice == {"name": "get_weather"}
    assert c.parallel_tool_calls is False
    assert (c.response_format.kind, c.response_format.value) == \
        ("json_schema", '{"type":"object","properties":{"a":{"type":"boolean"}}}')
    assert turn.echo["tools"] == [{**TOOL, "strict": True}]
    assert turn.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    fmt = _chat({"input": "x", "text": {"format": {"type": "json_object"}}}).response_format
    assert (fmt.kind, fmt.value) == ("json_object", "")
    assert _chat({"input": "x", "text": {"format": {"type": "text"}}}).response_format is None


def test_allowed_tools_offers_only_those():
    other = {**TOOL, "name": "other"}
    c = _chat({"input": "x", "tools": [TOOL, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "other"}]}})
    assert c.tool_choice == "required" and [t["function"]["name"] for t in c.tools] == ["other"]


def test_builtin_tools_are_refused_by_name():
    e = _err({"input": "x", "tools": [TOOL, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []},
                                      {"type": "code_interpreter"}, {"type": "computer_use_preview"}]})
    assert e.status == 400 and e.type == "invalid_request_error"
    assert e.message == ("tools: tool type(s) 'web_search', 'file_search', 'code_interpreter', "
                         "'computer_use_preview' not supported: kvserve runs function tools only; built-in tools "
                         "run on OpenAI's servers")
    e = _err({"input": "x", "tools": [TOOL], "tool_choice": {"type": "web_search_preview"}})
    assert e.status == 400 and "'web_search_preview' not supported" in e.message


def test_reasoning_effort_maps_to_template_and_budget():
    c = _chat({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}})
    assert c.reasoning.effort == "low" and c.reasoning.budget == 1024
    turn = chat_body({"input": "x", "reasoning": {"effort": "none"}}, ResponseStore())
    assert turn.fields["chat_template_kwargs"] == {"enable_thinking": False} and turn.chat.reasoning.budget == 0
    assert _chat({"input": "x", "reasoning": {"effort": "high"}}, budget=300).reasoning.budget == 300
    assert _chat({"input": "x", "reasoning": {"effort": "low"}}, budget=300).reasoning.budget == 300
    # the request's own thinking_token_budget wins (read with the model: its checks need the flags)
    turn = chat_body({"input": "x", "reasoning": {"effort": "high"}, "thinking_token_budget": 5}, ResponseStore())
    assert (turn.chat.reasoning.budget, turn.fields["thinking_token_budget"]) == (None, 5)
    assert _chat({"input": "x", "reasoning": {"summary": "auto"}}).reasoning.budget is None
    assert _err({"input": "x", "reasoning": {"effort": "max"}}).message.startswith("Field 'reasoning.effort'")


def test_previous_response_id_continues_the_stored_history():
    store = ResponseStore()
    store.put("resp_1", {"id": "resp_1"}, [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello", "tool_calls": [
                                               {"id": "c9", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}])
    turn = chat_body({"previous_response_id": "resp_1", "instructions": "New rules.",
                      "input": [{"type": "function_call_output", "call_id": "c9", "output": "42"}]}, store)
    assert turn.chat.messages == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "42", "name": "f"}]
    assert turn.history == turn.chat.messages[1:]
    e = _err({"previous_response_id": "resp_gone", "input": "x"}, store)
    assert (e.status, e.message, e.type) == (404, "Previous response with id 'resp_gone' not found.",
                                             "not_found_error")
    assert e.body()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, message", [
    ({}, "Missing required parameter: 'input'."),
    ({"input": 5}, "Field 'input': type must be string or array, but is number"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]: content type 'input_image' is not supported: kvserve's models read text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]},
     "input[0]: 'item_reference' is not supported: send the item itself or use previous_response_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]: item type 'web_search_call' is not supported"),
    ({"input": [{"role": "tool", "content": "x"}]},
     "input[0].role: expected 'user', 'assistant', 'system' or 'developer', got 'tool'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments: expected a JSON object as text, got '[1]'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]},
     "Missing required parameter: 'input[0].call_id'."),
    ({"input": "x", "max_output_tokens": 0}, "Field 'max_output_tokens': must be >= 1"),
    ({"input": "x", "background": True}, "'background' is not supported: kvserve answers while the request is open"),
    ({"input": "x", "top_logprobs": 3}, "'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
     "Missing required parameter: 'text.format.schema'."),
    ({"input": "x", "tool_choice": "sometimes"},
     "Field 'tool_choice': expected 'none', 'auto', 'required' or an object, got 'sometimes'"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "Field 'metadata': at most 16 pairs"),
    ({"input": ["x"] * (MAX_INPUT_ITEMS + 1)}, f"Field 'input': at most {MAX_INPUT_ITEMS} items, got 4097"),
    ({"input": "x", "max_output_tokens": 3.5}, "Field 'max_output_tokens': expected an integer, got 3.5"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": NaN}'}]},
     "input[0].arguments: expected a JSON object as text, got '{\"a\": NaN}'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a":' + "[" * 100_000}]},
     "Field 'input[0].arguments': nested deeper than 128 levels"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": '{"a":' + "[" * 128 + "]" * 128 + "}"}]},
     "Field 'input[0].arguments': nested deeper than 128 levels"),
    ({"input": [{"id": {"evil": [1, 2]}, "role": "user", "content": "x"}]},
     "Field 'input[0].id': type must be string, but is object"),
    ({"input": [{"id": i, "role": "user", "content": "x"} for i in ["msg_Y", "msg_A", "msg_X", "msg_A"]]},
     "Duplicate item found with id msg_A. Remove duplicate items from your input and try again."),
])
def test_bad_requests_are_400_naming_the_field(body, message):
    e = _err(body)
    assert (e.status, e.message) == (400, message)


HOSTILE = [None, 0, -1, 1.5, 1e308, True, "", "x", [], [None], {}, {"type": "x"}, [{}], [{"type": None}], [[]],
           {"a": {"b": []}}]
FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
          "previous_response_id", "store", "stream", "metadata", "parallel_tool_calls", "include", "truncation",
          "user", "top_logprobs", "background", "conversation", "prompt"]


def _translates_or_400(body: dict) -> None:
    try:
        chat_body(body, ResponseStore())
    except ApiError as e:
        assert 400 <= e.status < 500, (body, e.status, e.message)


@pytest.mark.parametrize("key", FIELDS)
def test_hostile_values_are_translated_or_refused_with_a_4xx(key):
    for v in HOSTILE:
        _translates_or_400({"input": "hi", key: v})
        # the same value one level down, where the nested objects are read
        for outer, inner in [("reasoning", "effort"), ("reasoning", "summary"), ("text", "format"),
                             ("text", "verbosity"), ("tool_choice", "name"), ("tool_choice", "tools")]:
            body = {"input": "hi", outer: {"type": "function" if outer == "tool_choice" else "x", inner: v},
                    "tools": [TOOL]}
            _translates_or_400(body)
        for item in [{"type": "message", "role": "user", "content": v}, {"role": v, "content": "x"},
                     {"type": "function_call", "call_id": v, "name": "f", "arguments": "{}"},
                     {"type": "function_call", "call_id": "c", "name": "f", "arguments": v},
                     {"type": "function_call_output", "call_id": "c", "output": v},
                     {"type": "reasoning", "content": v}, {"type": "reasoning", "summary": [v]}, {"type": v}]:
            _translates_or_400({"input": [item]})
        for tool in [{"type": "function", "name": v}, {"type": "function", "name": "f", "parameters": v},
                     {"type": "function", "name": "f", "strict": v}, {"type": "function", "name": "f",
                                                                        "description": v}]:
            _translates_or_400({"input": "hi", "tools": [tool]})
        _translates_or_400({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": v}}})


# -- the serving layer's chat events -> items and events (a fake event stream, no engine) ---------

def _chunks(*deltas: dict, finish: str = "stop", usage: ChatUsage | None = None) -> list[ChatEvent]:
    """The events of one choice: an empty first one (the engine's first output may carry no
    text), one per delta, then the finish with the usage."""
    out = [ChatEvent(0, None, [])]
    out += [ChatEvent(0, None, [_piece(d)]) for d in deltas]
    out.append(ChatEvent(0, None, [], finish_reason="stop" if finish == "tool_calls" else finish,
                         called_tools=finish == "tool_calls",
                         usage=usage or ChatUsage(prompt_tokens=9, completion_tokens=5, cached_tokens=4,
                                                  reasoning_tokens=2)))
    return out


def _piece(d: dict):
    """A piece of the serving layer's answer, written here in OpenAI's delta shape for short tests."""
    if "tool_calls" in d:
        (c,) = d["tool_calls"]
        return ToolCallPiece(c["index"], c["id"], c["function"]["name"], c["function"]["arguments"])
    if "content" in d:
        return TextPiece(d["content"])
    return ReasoningPiece(d.get("reasoning_content") or d["reasoning"])


def _run(monkeypatch, chunks: list, body: dict | None = None, fail: Exception | None = None):
    import asyncio
    from types import SimpleNamespace

    import kvserve.faces.responses as face

    async def fake_stream(runner, plan, view=None):
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    monkeypatch.setattr(face, "chat_events", fake_stream)
    store = ResponseStore()
    turn = chat_body(body or {"input": "hi"}, store)
    plan = SimpleNamespace(model="m", grammar="", requests=[SimpleNamespace(params=SimpleNamespace(temperature=0.8, top_p=0.95))])
    job = face._Run(None, plan, turn, store)

    async def collect():
        return [e async for e in job.events()]

    return asyncio.run(collect()), job, store


def test_reasoning_text_and_calls_become_items_in_order(monkeypatch):
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    events, _, store = _run(monkeypatch, _chunks({"reasoning_content": "think"}, {"reasoning_content": "ing"},
                                                   {"content": "\n"}, {"content": "Hello"}, {"content": " you"},
                                                   {"content": "\n\n"}, {"tool_calls": [call]}, {"content": "\n"},
                                                   finish="tool_calls"))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # the blank line before the text joins it; the blank lines after the last text stay in the message
    assert events[11]["delta"] == "\nHello" and events[14]["text"] == "\nHello you\n\n"
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert final["output"][2]["call_id"] == "call_1" and final["output"][2]["arguments"] == '{"a": 1}'
    assert final["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 14}
    assert (final["temperature"], final["top_p"], final["model"]) == (0.8, 0.95, "m")
    stored = store.get(final["id"])
    assert stored.response == final
    assert stored.history == ({"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "\nHello you\n\n", "reasoning_content": "thinking",
                               "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "f", "arguments": '{"a": 1}'}}]})


def test_blank_text_between_calls_is_dropped(monkeypatch):
    c = [{"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
         for i in range(2)]
    events, _, _ = _run(monkeypatch, _chunks({"content": "\n"}, {"tool_calls": [c[0]]}, {"content": "\n"},
                                             {"tool_calls": [c[1]]}, {"content": " "}, finish="tool_calls"))
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["function_call", "function_call"]


def test_an_empty_answer_is_an_empty_message_and_length_is_incomplete(monkeypatch):
    events, _, _ = _run(monkeypatch, _chunks(finish="stop"))
    assert [e["type"] for e in events[2:]] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.done", "response.content_part.done",
                                               "response.output_item.done", "response.completed"]
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "output_text", "text": "",
                                                               "annotations": []}]
    events, _, _ = _run(monkeypatch, _chunks({"content": "cut"}, finish="length"))
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_an_engine_error_fails_the_response(monkeypatch):
    from kvserve.errors import InvalidInputError

    events, _, store = _run(monkeypatch, [_chunks({"content": "a"})[1]], body={"input": "hi", "store": True},
                            fail=InvalidInputError("bad thing"))
    final = events[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"] == {"code": "invalid_request_error", "message": "bad thing"}
    assert final["response"]["usage"] is None
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in final["response"]["output"]] == [
        ("message", "incomplete", "a")]
    assert store.get(final["response"]["id"]).response["status"] == "failed"


def test_store_false_keeps_nothing(monkeypatch):
    events, _, store = _run(monkeypatch, _chunks({"content": "a"}), body={"input": "hi", "store": False})
    assert events[-1]["response"]["store"] is False and len(store) == 0


def test_input_items_as_listed():
    turn = chat_body({"input": [{"role": "user", "content": "hi"},
                                {"type": "message", "role": "assistant", "id": "msg_mine",
                                 "content": [{"type": "output_text", "text": "yo", "annotations": []}]},
                                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c1", "output": "1"}]}, ResponseStore())
    items = turn.input_items
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "fc", "fco"] and items[1]["id"] == "msg_mine"
    assert items[0] == {"id": items[0]["id"], "role": "user", "content": [{"type": "input_text", "text": "hi"}],
                        "type": "message", "status": "completed"}
    assert items[3] == {"id": items[3]["id"], "type": "function_call_output", "call_id": "c1", "output": "1",
                        "status": "completed"}
    assert chat_body({"input": "x", "store": False}, ResponseStore()).input_items == []


# -- the reviewer's findings (attack 16r) --------------------------------------------------------

def _nest(depth: int):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def test_allowed_tools_matches_names_in_linear_time_and_echoes_known_fields():
    import time

    tools = [{"type": "function", "name": f"f{i}"} for i in range(20_000)]
    t = time.perf_counter()
    c = _chat({"input": "x", "tools": tools, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                             "tools": tools}})
    took = time.perf_counter() - t
    assert len(c.tools) == 20_000 and c.tool_choice == "auto"
    assert took < 2.0  # a list lookup per tool took ~8 s (20,000 x 20,000 string compares)
    turn = chat_body({"input": "x", "tools": [TOOL], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "x": _nest(900),
        "tools": [{"type": "function", "name": "get_weather", "junk": {"a": 1}}]}}, ResponseStore())
    assert turn.echo["tool_choice"] == {"type": "allowed_tools", "mode": "required",
                                        "tools": [{"type": "function", "name": "get_weather"}]}


def test_echoed_values_nested_too_deep_are_400_naming_the_field():
    deep, ok = {"type": "object", "x": _nest(128)}, {"type": "object", "x": _nest(127)}  # 129 and 128 levels
    for body, where in [({"input": "x", "tools": [{**TOOL, "parameters": deep}]}, "tools[0].parameters"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": deep}}},
                         "text.format.schema")]:
        e = _err(body)
        assert (e.status, e.message, e.body()["error"]["param"]) == (
            400, f"Field '{where}': nested deeper than 128 levels", where)
    assert _chat({"input": "x", "tools": [{**TOOL, "parameters": ok}]}).tools[0]["function"]["parameters"] == ok
    # a client's extra keys in text are not echoed (they were, at any depth, and failed the encoder)
    turn = chat_body({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": ok,
                                                        "strict": True, "y": _nest(950)},
                                             "verbosity": "low", "x": _nest(950)}}, ResponseStore())
    assert turn.echo["text"] == {"format": {"type": "json_schema", "name": "n", "schema": ok, "strict": True},
                                 "verbosity": "low"}
    assert chat_body({"input": "x", "text": {"x": 1}}, ResponseStore()).echo["text"] == {"format": {"type": "text"}}


def test_input_items_are_stored_with_known_fields_only(monkeypatch):
    items = [{"role": "user", "content": "hi", "x": [{}] * 1000},
             {"type": "message", "role": "assistant", "id": "msg_a", "status": "incomplete", "junk": 1,
              "content": [{"type": "output_text", "text": "yo", "annotations": [{"evil": 1}], "z": 2},
                          {"type": "refusal", "refusal": "no", "z": 3}]},
             {"type": "function_call", "id": "fc_a", "call_id": "c1", "name": "f", "arguments": "{}", "q": {}},
             {"type": "function_call_output", "id": "fco_a", "call_id": "c1", "status": "bogus", "q": [],
              "output": [{"type": "input_text", "text": "1", "q": 1}]},
             {"type": "reasoning", "id": "rs_a", "summary": [{"type": "summary_text", "text": "s", "q": 1}],
              "encrypted_content": "e", "q": 1}]
    events, _, store = _run(monkeypatch, _chunks({"content": "ok"}), body={"input": items})
    listed = store.get(events[-1]["response"]["id"]).input_items
    assert listed[1:] == (
        {"id": "msg_a", "type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "yo", "annotations": []}, {"type": "refusal", "refusal": "no"}]},
        {"id": "fc_a", "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
         "status": "completed"},
        {"id": "fco_a", "type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "1"}], "status": "completed"},
        {"id": "rs_a", "type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
         "encrypted_content": "e"})
    assert listed[0] == {"id": listed[0]["id"], "type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "hi"}], "status": "completed"}
    # the store counts exactly the bytes it holds: the entry's compact JSON texts
    e = store.get(events[-1]["response"]["id"])
    assert store.nbytes == e.nbytes == len(e.response_json) + len(e.history_json) + len(e.input_items_json)
    assert b'"x"' not in e.input_items_json and b"junk" not in e.input_items_json and len(e.input_items_json) < 700


def test_every_response_and_event_validates_with_the_openai_client_types(monkeypatch):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events_type = TypeAdapter(ResponseStreamEvent)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}}
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    cases = {
        "text": (_chunks({"content": "Hello"}), {"input": "hi"}),
        "tools": (_chunks({"tool_calls": [call]}, finish="tool_calls"),
                  {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                                   "tools": [{"type": "function",
                                                                              "name": "get_weather"}]}}),
        "json_schema": (_chunks({"content": '{"a": true}'}),
                        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema,
                                                            "strict": True}}}),
        "reasoning": (_chunks({"reasoning_content": "hm"}, {"content": "ok"}),
                      {"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}),
        "incomplete": (_chunks({"content": "cut"}, finish="length"), {"input": "hi", "max_output_tokens": 1}),
    }
    for name, (chunks, body) in cases.items():
        events, _, store = _run(monkeypatch, chunks, body=body)
        for ev in events:
            assert events_type.validate_python(ev).type == ev["type"], name
        final = Response.model_validate(events[-1]["response"])
        assert final.usage.input_tokens_details.cache_write_tokens == 0, name
        assert Response.model_validate(store.get(final.id).response).id == final.id
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"


def test_the_stored_entry_is_written_off_the_event_loop_for_its_owner(monkeypatch):
    import threading

    threads = []
    real_put = ResponseStore.put

    def put(self, *a, **kw):
        threads.append(threading.current_thread())
        return real_put(self, *a, **kw)

    monkeypatch.setattr(ResponseStore, "put", put)
    import asyncio
    from types import SimpleNamespace

    import kvserve.faces.responses as face

    async def fake_stream(runner, plan, view=None):
        for c in _chunks({"content": "a"}):
            yield c

    monkeypatch.setattr(face, "chat_events", fake_stream)
    store = ResponseStore()
    turn = chat_body({"input": "hi"}, store, owner="k1")
    plan = SimpleNamespace(model="m", grammar="", requests=[SimpleNamespace(params=SimpleNamespace(temperature=0.8, top_p=0.95))])
    job = face._Run(None, plan, turn, store)

    async def collect():
        return [e async for e in job.events()], threading.current_thread()

    events, loop_thread = asyncio.run(collect())
    assert len(threads) == 1 and threads[0] is not loop_thread
    rid = events[-1]["response"]["id"]
    assert store.get(rid) is None and store.get(rid, "k1").response == events[-1]["response"]
    e = _err({"input": "x", "previous_response_id": rid}, store)
    assert (e.status, e.message) == (404, f"Previous response with id '{rid}' not found.")
    assert chat_body({"input": "x", "previous_response_id": rid}, store, owner="k1").history[0] == {
        "role": "user", "content": "hi"}
