"""OpenAI's Responses API (/v1/responses) against real ``kvserve serve`` processes running the
tiny random-weight model, through the official ``openai`` client, openai-agents' default model
path and pydantic-ai's ``Agent("openai:...")``.

The tiny model's text is random, so exact expectations come from the chat face: the same
request through /v1/chat/completions must give the same text and token counts (both run
greedy). Tool calls and JSON output are grammar-constrained, so they are valid whatever the
weights. Servers: ``hermes`` (tests/templates/hermes_tools.jinja: tools) and ``think``
(tests/templates/think.jinja: the generation prompt opens a thinking block).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"type": "string",
                                                                                 "enum": ["Paris", "Oslo"]}},
          "required": ["ok", "city"], "additionalProperties": False}
MODEL = "tiny"
G = {"temperature": 0}  # greedy: the same request gives the same text


@pytest.fixture(scope="module")
def hermes(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(TEMPLATES / "hermes_tools.jinja"), "-np", "2",
                               "-c", "2048", model=tiny_gguf)


@pytest.fixture(scope="module")
def think(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(TEMPLATES / "think.jinja"), "-np", "1", "-c", "1024",
                               model=tiny_gguf)


@pytest.fixture(scope="module")
def client(hermes) -> openai.OpenAI:
    return openai.OpenAI(base_url=hermes.url("/v1"), api_key="x", max_retries=0, timeout=120)


def _chat(srv, messages: list[dict], **kw) -> dict:
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": messages, **G, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_tokens(srv, messages: list[dict], **kw) -> int:
    return _chat(srv, messages, max_tokens=1, **kw)["usage"]["prompt_tokens"]


# -- the openai client ------------------------------------------------------------------------

def test_create_text_matches_the_chat_face(client, hermes):
    chat = _chat(hermes, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 max_tokens=6)
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=6, **G)
    ch = chat["choices"][0]
    assert r.id.startswith("resp_") and r.object == "response"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == ch["message"]["content"]
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if ch["finish_reason"] == "length" else ("completed", None))
    assert r.output[0].status == r.status
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], chat["usage"]["total_tokens"])
    assert u.output_tokens == 6 and u.output_tokens_details.reasoning_tokens == 0
    # the chat request computed the same prompt: all of it but the one token always evaluated is reused
    assert u.input_tokens_details.cached_tokens == u.input_tokens - 1
    assert (r.instructions, r.max_output_tokens, r.temperature, r.tool_choice, r.tools, r.store) == (
        "Be brief.", 6, 0.0, "auto", [], True)


def test_forced_tool_call_and_function_call_output_round_trip(client, hermes):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=128, **G)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.status == "completed" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required" and r.parallel_tool_calls is False

    # stateless round trip, as agent loops send it: the call item back, then its output
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = client.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False, max_output_tokens=3, **G)
    chat_msgs = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                    "parameters": CITY}}]
    expected = _prompt_tokens(hermes, chat_msgs, tools=chat_tools)
    assert r2.usage.input_tokens == expected
    # the same through previous_response_id: the stored turn stands in for the first two items
    r3 = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=3,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 21 C"}], **G)
    assert r3.usage.input_tokens == expected and r3.previous_response_id == r.id
    assert r3.output_text == r2.output_text
    # its input items: this request's only
    assert [i.type for i in client.responses.input_items.list(r3.id)] == ["function_call_output"]
    with pytest.raises(openai.NotFoundError):  # r2 was not stored
        client.responses.input_items.list(r2.id)


def test_named_tool_choice(client):
    other = {**WEATHER, "name": "get_time", "description": "Local time of a city"}
    r = client.responses.create(model=MODEL, input="x", tools=[WEATHER, other], max_output_tokens=128,
                                tool_choice={"type": "function", "name": "get_time"}, **G)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "get_time")]
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time"


def test_json_schema_format_gives_valid_json(client):
    r = client.responses.create(model=MODEL, input="Answer in JSON.", max_output_tokens=96, **G,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_previous_response_id_includes_the_earlier_turn(client, hermes):
    r1 = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Remember names.",
                                 max_output_tokens=4, **G)
    r2 = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=r1.id,
                                 max_output_tokens=4, **G)
    # instructions are not carried over; the earlier input and output are
    with_history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": r1.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert r2.usage.input_tokens == _prompt_tokens(hermes, with_history)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=1, **G)
    assert alone.usage.input_tokens == _prompt_tokens(hermes, with_history[2:])
    assert r2.usage.input_tokens > alone.usage.input_tokens
    # a third turn chains through both
    r3 = client.responses.create(model=MODEL, input="Again?", previous_response_id=r2.id, max_output_tokens=1, **G)
    assert r3.usage.input_tokens == _prompt_tokens(
        hermes, with_history + [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Again?"}])


def test_retrieve_delete_and_missing_ids(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **G)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert [(i.type, i.role, i.content[0].text) for i in client.responses.input_items.list(r.id)] == [
        ("message", "user", "Hi")]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.status_code == 404 and e.value.body["message"] == f"Response with id '{r.id}' not found."
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert e.value.body["message"] == f"Previous response with id '{r.id}' not found."
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False, **G)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_pages(client, hermes):
    texts = ["one", "two", "three"]
    r = client.responses.create(model=MODEL, max_output_tokens=1, **G, input=[
        {"role": "user" if i != 1 else "assistant", "content": t} for i, t in enumerate(texts)])
    page = client.responses.input_items.list(r.id, limit=1)
    assert [i.content[0].text for i in page.data] == ["three"] and page.has_more
    assert [i.content[0].text for i in page] == ["three", "two", "one"]  # the client follows after=<last_id>
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc")] == texts
    assert client.responses.input_items.list(r.id, order="asc").data[1].content[0].type == "output_text"
    bad = httpx.get(hermes.url(f"/v1/responses/{r.id}/input_items?limit=0"), timeout=30)
    assert (bad.status_code, bad.json()["error"]["message"]) == (
        400, "Field 'limit': expected an integer from 1 to 100, got '0'")


def test_stream_text_events_in_order(client):
    with client.responses.stream(model=MODEL, input="Answer in JSON.", max_output_tokens=96, **G,
                                 text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) == final.usage.output_tokens - 1  # one event per token; the end-of-turn token has no text
    assert "".join(deltas) == final.output_text == events[-2].item.content[0].text == events[-4].text
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    assert events[-1].response.status == "completed" and events[-1].response.id == events[0].response.id
    # the streamed response was stored like any other
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_function_call_events(client):
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=128, **G) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    call = final.output[0]
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    assert events[3].delta == events[4].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_a_client_that_leaves_aborts_the_generation(hermes):
    import time

    with httpx.stream("POST", hermes.url("/v1/responses"), timeout=120,
                      json={"input": "Hi", "max_output_tokens": 900, "stream": True, "store": False, **G}) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break  # leave after the first token
    deadline = time.monotonic() + 10
    while True:
        slots = httpx.get(hermes.url("/slots"), timeout=30).json()
        if not any(s["is_processing"] for s in slots) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    latest = max(slots, key=lambda s: s["id_task"])
    assert not latest["is_processing"]
    # aborted, not run to max_output_tokens (the idle slot holds the prompt and what was generated)
    generated = latest["n_prompt_tokens"] - latest["n_prompt_tokens_processed"] - latest["n_prompt_tokens_cache"] + 1
    assert 0 < generated < 900 and latest["next_token"][0]["n_decoded"] == 0


def test_wire_format_and_errors(hermes):
    with httpx.stream("POST", hermes.url("/v1/responses"), timeout=120,
                      json={"input": "Hi", "max_output_tokens": 1, "stream": True, **G}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("event: ") for b in blocks) and "[DONE]" not in text
    first_event, first_data = blocks[0].split("\n")
    assert first_event == "event: response.created" and json.loads(first_data[6:])["type"] == "response.created"
    assert blocks[-1].startswith("event: response.incomplete\n")
    # OpenAI's error envelope, 400 naming the refused tool types
    r = httpx.post(hermes.url("/v1/responses"), json={"input": "x", "tools": [{"type": "web_search"}]}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "type": "invalid_request_error", "param": "tools", "message":
                                  "tools: tool type(s) 'web_search' not supported: kvserve runs function tools "
                                  "only; built-in tools run on OpenAI's servers"}}
    r = httpx.get(hermes.url("/v1/responses/resp_nope"), timeout=60)
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error")
    r = httpx.post(hermes.url("/v1/responses"), content=b"{", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON")


def test_builtin_tools_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "file_search", "vector_store_ids": ["v"]}])
    assert "'file_search' not supported" in e.value.message


# -- reasoning ---------------------------------------------------------------------------------

def test_reasoning_item_then_message(think):
    c = openai.OpenAI(base_url=think.url("/v1"), api_key="x", max_retries=0, timeout=120)
    body = dict(model=MODEL, input="Hi", max_output_tokens=24, extra_body={"thinking_token_budget": 4}, **G)
    r = c.responses.create(**body)
    chat = _chat(think, [{"role": "user", "content": "Hi"}], max_tokens=24, thinking_token_budget=4)
    msg = chat["choices"][0]["message"]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == msg["reasoning_content"] and r.output[0].summary == []
    assert r.output_text == msg["content"]
    assert r.usage.output_tokens_details.reasoning_tokens == chat["usage"]["completion_tokens_details"][
        "reasoning_tokens"] > 0
    with c.responses.stream(**body) as s:
        types = [e.type for e in s]
    n_think = types.count("response.reasoning_text.delta")
    n_text = types.count("response.output_text.delta")
    assert n_think >= 1 and n_text >= 1
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * n_think, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * n_text, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", r.status and "response." + r.status]


def test_reasoning_effort_none_turns_thinking_off(think):
    c = openai.OpenAI(base_url=think.url("/v1"), api_key="x", max_retries=0, timeout=120)
    r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=8, reasoning={"effort": "none"}, **G)
    assert [o.type for o in r.output] == ["message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.reasoning.effort == "none"
    chat = _chat(think, [{"role": "user", "content": "Hi"}], max_tokens=8,
                 chat_template_kwargs={"enable_thinking": False})
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]


# -- agent frameworks --------------------------------------------------------------------------

def test_openai_agents_default_model_path(hermes, client):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=hermes.url("/v1"), api_key="x",
                                                               max_retries=0, timeout=120))
    assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)  # the default API is Responses
    agent = Agent(name="weather", instructions="Use the tool.", model=MODEL, tools=[get_weather],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, max_tokens=128,
                                               temperature=0))
    result = asyncio.run(Runner.run(agent, "Weather in Paris?",
                                    run_config=RunConfig(model_provider=provider, tracing_disabled=True)))
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]
    # the model call went to /v1/responses: the response it got is stored there
    stored = client.responses.retrieve(result.raw_responses[0].response_id)
    assert stored.instructions == "Use the tool." and [(o.type, o.name) for o in stored.output] == [
        ("function_call", "get_weather")]


class _City(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]


_PAI_SETTINGS = {"temperature": 0, "max_tokens": 128, "parallel_tool_calls": False}


def test_pydantic_ai_default_openai_model(hermes, monkeypatch):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel

    monkeypatch.setenv("OPENAI_BASE_URL", hermes.url("/v1"))
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    agent = Agent(f"openai:{MODEL}", output_type=_City, model_settings=_PAI_SETTINGS)
    assert isinstance(agent.model, OpenAIResponsesModel)  # "openai:" is the Responses API in this version
    result = agent.run_sync("Which city?")
    assert result.output.city in ("Paris", "Oslo")
    assert result.usage.requests == 1 and result.usage.input_tokens > 0


def test_pydantic_ai_responses_model_with_a_provider(hermes, client):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=hermes.url("/v1"), api_key="x"))
    result = Agent(model, output_type=_City, model_settings=_PAI_SETTINGS).run_sync("Which city?")
    assert result.output.city in ("Paris", "Oslo")
    # the answer came from /v1/responses: kvserve stored it under the id pydantic-ai saw
    stored = client.responses.retrieve(result.response.provider_response_id)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in stored.output] == [
        ("function_call", "final_result", {"city": result.output.city})]


# -- in process: API keys, query parsing, work off the event loop (the reviewer's findings) --------

@pytest.fixture(scope="module")
def keyed(tiny_gguf, tmp_path_factory):
    from starlette.testclient import TestClient

    from kvserve.app import build_app
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    d = tmp_path_factory.mktemp("resp_keys")
    state = ServerState(parse_args(["-m", tiny_gguf, "-a", MODEL, "-c", "1024", "-np", "1", "--models-dir",
                                    str(d / "models"), "--api-key", "keyA", "--api-key", "keyB"]))
    with TestClient(build_app(state), base_url="http://127.0.0.1") as c:
        c.portal.call(state.preload)
        yield c
        c.portal.call(state.manager.shutdown)


KEY_A, KEY_B = {"Authorization": "Bearer keyA"}, {"X-Api-Key": "keyB"}


def test_a_stored_response_is_seen_by_the_key_that_created_it_only(keyed):
    r = keyed.post("/v1/responses", headers=KEY_A, json={"input": "Hi", "max_output_tokens": 2, **G})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    missing = {"error": {"code": 404, "message": f"Response with id '{rid}' not found.", "type": "not_found_error"}}
    for method, path in [("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
                         ("DELETE", f"/v1/responses/{rid}")]:
        other = keyed.request(method, path, headers=KEY_B)
        assert (other.status_code, other.json()) == (404, missing), (method, path)
    cont = keyed.post("/v1/responses", headers=KEY_B, json={"input": "x", "previous_response_id": rid})
    assert (cont.status_code, cont.json()["error"]["message"]) == (404, f"Previous response with id '{rid}' not found.")
    # the owner still has all of it
    got = keyed.get(f"/v1/responses/{rid}", headers={"X-Api-Key": "keyA"})
    assert got.status_code == 200 and got.content == r.content
    assert [i["content"] for i in keyed.get(f"/v1/responses/{rid}/input_items", headers=KEY_A).json()["data"]] == [
        [{"type": "input_text", "text": "Hi"}]]
    cont = keyed.post("/v1/responses", headers=KEY_A, json={"input": "x", "previous_response_id": rid,
                                                            "max_output_tokens": 1, **G})
    assert cont.status_code == 200 and cont.json()["previous_response_id"] == rid
    assert keyed.delete(f"/v1/responses/{rid}", headers=KEY_A).json() == {"id": rid, "object": "response",
                                                                           "deleted": True}


def test_queries_are_ascii_and_stored_responses_do_not_stream(keyed):
    rid = keyed.post("/v1/responses", headers=KEY_A, json={"input": "Hi", "max_output_tokens": 1, **G}).json()["id"]
    for q, shown in [("limit=%C2%B2", "\u00b2"), ("limit=%D9%A3", "\u0663"), ("limit=" + "0" * 5000, "0" * 64),
                     ("limit=%2B5", "+5"), ("limit=", "")]:
        r = keyed.get(f"/v1/responses/{rid}/input_items?{q}", headers=KEY_A)
        assert (r.status_code, r.json()["error"]["message"]) == (
            400, f"Field 'limit': expected an integer from 1 to 100, got {shown!r}".replace("\\\\", "\\")), q
    assert keyed.get(f"/v1/responses/{rid}/input_items?limit=007", headers=KEY_A).status_code == 200
    r = keyed.get(f"/v1/responses/{rid}?stream=true", headers=KEY_A)
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "Streaming a stored response is not supported: GET it without 'stream'")
    assert keyed.get(f"/v1/responses/{rid}?stream=false", headers=KEY_A).status_code == 200


def test_translation_store_writes_and_listings_run_off_the_event_loop(keyed, monkeypatch):
    import threading

    import kvserve.faces.responses as face
    from kvserve.serving.response_store import ResponseStore

    seen: dict[str, list] = {"chat_body": [], "put": [], "list": [], "loop": []}

    def spy(name, fn):
        def wrapped(*a, **kw):
            seen[name].append(threading.current_thread())
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(face, "chat_body", spy("chat_body", face.chat_body))
    monkeypatch.setattr(face, "_items_page_json", spy("list", face._items_page_json))
    monkeypatch.setattr(ResponseStore, "put", spy("put", ResponseStore.put))

    async def loop_thread():
        seen["loop"].append(threading.current_thread())

    keyed.portal.call(loop_thread)
    rid = keyed.post("/v1/responses", headers=KEY_A, json={"input": "Hi", "max_output_tokens": 1, **G}).json()["id"]
    assert keyed.get(f"/v1/responses/{rid}/input_items", headers=KEY_A).status_code == 200
    assert [len(seen[k]) for k in ("chat_body", "put", "list")] == [1, 1, 1]
    assert all(seen[k][0] is not seen["loop"][0] for k in ("chat_body", "put", "list"))
    # a refused request (an echoed value nested too deep) is never stored
    deep = "[" * 900 + "]" * 900  # the reviewer: the answer failed to encode from ~952 levels
    for body, where in [('"tools":[{"type":"function","name":"f","parameters":{"x":D}}]', "tools[0].parameters"),
                        ('"text":{"format":{"type":"json_schema","name":"n","schema":{"x":D}}}',
                         "text.format.schema")]:
        for stream in ("false", "true"):
            raw = f'{{"input":"hi","max_output_tokens":2,"stream":{stream},{body.replace("D", deep)}}}'
            r = keyed.post("/v1/responses", headers=KEY_A, content=raw)
            assert (r.status_code, r.json()["error"]["message"]) == (
                400, f"Field '{where}': nested deeper than 128 levels")
    assert len(seen["put"]) == 1


def test_input_tokens_counts_what_create_would_run(client, hermes):
    """``POST /v1/responses/input_tokens`` (and without ``/v1``, as llama-server serves it): the
    prompt's length as ``/v1/responses`` would run it, ``previous_response_id`` included; nothing
    runs; a bad field is the same 400 as on create."""
    r1 = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=3, **G)
    body = {"model": MODEL, "input": "What is my name?", "instructions": "Be brief."}
    want = _prompt_tokens(hermes, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is my name?"}])
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        r = httpx.post(hermes.url(path), json=body, timeout=60)
        assert (r.status_code, r.json()) == (200, {"object": "response.input_tokens", "input_tokens": want})
    chained = httpx.post(hermes.url("/v1/responses/input_tokens"), timeout=60,
                         json={"input": "What is my name?", "previous_response_id": r1.id}).json()
    assert chained["input_tokens"] == _prompt_tokens(hermes, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"}])
    bad = httpx.post(hermes.url("/v1/responses/input_tokens"), json={"input": "x", "truncation": "middle"},
                     timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "Field 'truncation': expected 'auto' or 'disabled', got 'middle'"
    missing = httpx.post(hermes.url("/v1/responses/input_tokens"), json={"previous_response_id": "resp_x",
                                                                         "input": "x"}, timeout=60)
    assert missing.status_code == 404
