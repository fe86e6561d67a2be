"""Responses API request -> the chat-completions body the OpenAI face plans
(kvserve/faces/responses.py chat_body), without a server: input items, tools, tool_choice,
text.format, reasoning, previous_response_id and the 400/404s."""

from __future__ import annotations

import pytest

from kvserve.faces.errors import ApiError
from kvserve.faces.responses import MAX_INPUT_ITEMS, chat_body
from kvserve.serving.response_store import ResponseStore

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": TOOL["parameters"]}}


def _chat(body: dict, store: ResponseStore | None = None, budget: int = -1) -> dict:
    return chat_body(body, store or ResponseStore(), budget).chat


def _err(body: dict, store: ResponseStore | None = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat_body(body, store or ResponseStore())
    return e.value


def test_string_input_and_instructions():
    turn = chat_body({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.2,
                      "top_p": 0.5, "top_k": 3, "seed": 9}, ResponseStore())
    assert turn.chat == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                         "stream": True, "stream_options": {"include_usage": True}, "continue_final_message": False,
                         "top_k": 3, "seed": 9, "temperature": 0.2, "top_p": 0.5, "max_tokens": 7,
                         "parallel_tool_calls": True}
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
    assert _chat({"input": items})["messages"] == [
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
    msgs = _chat({"input": items})["messages"]
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
    assert c["tools"] == [CHAT_TOOL]
    assert c["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert c["parallel_tool_calls"] is False
    assert c["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                            "strict": True}}
    assert turn.echo["tools"] == [{**TOOL, "strict": True}]
    assert turn.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert _chat({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == \
        {"type": "json_object"}
    assert "response_format" not in _chat({"input": "x", "text": {"format": {"type": "text"}}})


def test_allowed_tools_offers_only_those():
    other = {**TOOL, "name": "other"}
    c = _chat({"input": "x", "tools": [TOOL, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "other"}]}})
    assert c["tool_choice"] == "required" and [t["function"]["name"] for t in c["tools"]] == ["other"]


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
    assert c["reasoning_effort"] == "low" and c["thinking_token_budget"] == 1024
    c = _chat({"input": "x", "reasoning": {"effort": "none"}})
    assert c["chat_template_kwargs"] == {"enable_thinking": False} and c["thinking_token_budget"] == 0
    assert _chat({"input": "x", "reasoning": {"effort": "high"}}, budget=300)["thinking_token_budget"] == 300
    assert _chat({"input": "x", "reasoning": {"effort": "low"}}, budget=300)["thinking_token_budget"] == 300
    assert _chat({"input": "x", "reasoning": {"effort": "high"}, "thinking_token_budget": 5})[
        "thinking_token_budget"] == 5
    assert "thinking_token_budget" not in _chat({"input": "x", "reasoning": {"summary": "auto"}})
    assert _err({"input": "x", "reasoning": {"effort": "max"}}).message.startswith("Field 'reasoning.effort'")


def test_previous_response_id_continues_the_stored_history():
    store = ResponseStore()
    store.put("resp_1", {"id": "resp_1"}, [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello", "tool_calls": [
                                               {"id": "c9", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}])
    turn = chat_body({"previous_response_id": "resp_1", "instructions": "New rules.",
                      "input": [{"type": "function_call_output", "call_id": "c9", "output": "42"}]}, store)
    assert turn.chat["messages"] == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "42", "name": "f"}]
    assert turn.history == turn.chat["messages"][1:]
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


# -- chat chunks -> items and events (a fake chat stream, no engine) ---------------------------

def _chunks(*deltas: dict, finish: str = "stop", usage: dict | None = None) -> list[dict]:
    out = [{"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]}]
    out += [{"choices": [{"finish_reason": None, "index": 0, "delta": d}]} for d in deltas]
    out.append({"choices": [{"finish_reason": finish, "index": 0, "delta": {}}]})
    out.append({"choices": [], "usage": usage or {"completion_tokens": 5, "prompt_tokens": 9, "total_tokens": 14,
                                                  "prompt_tokens_details": {"cached_tokens": 4},
                                                  "completion_tokens_details": {"reasoning_tokens": 2}}})
    return out


def _run(monkeypatch, chunks: list, body: dict | None = None, fail: Exception | None = None):
    import asyncio
    from types import SimpleNamespace

    import kvserve.faces.responses as face

    async def fake_stream(runner, plan):
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    monkeypatch.setattr(face, "stream_events", fake_stream)
    store = ResponseStore()
    turn = chat_body(body or {"input": "hi"}, store)
    plan = SimpleNamespace(model="m", requests=[SimpleNamespace(params=SimpleNamespace(temperature=0.8, top_p=0.95))])
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
    assert final["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
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
