"""Tools on the default model (SmolLM2: its template renders no tools) through llama-server's
generic format: forced and auto calls with the official ``openai`` and ``anthropic`` clients, a
forced call cut by max_tokens, the prompt the model sees, and the start-up line of vLLM's flags."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

# an enum keeps every forced call short whatever the CPU's numerics: the grammar then guarantees it ends
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"],
                  "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url("/v1"), api_key="x", max_retries=0)


def _weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert list(args) == ["city"] and args["city"] in ("Paris", "London")
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_forced_call(oai, choice):
    r = oai.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                    temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content in (None, "")
    assert len(c.message.tool_calls) == 1
    if isinstance(choice, dict):
        _weather_call(c.message.tool_calls[0])


def test_openai_forced_call_streamed_whole(oai):
    chunks = list(oai.chat.completions.create(model="x", messages=MSGS, tools=TOOLS[:1], tool_choice="required",
                                              max_tokens=60, temperature=0, stream=True, parallel_tool_calls=False))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) >= 1 and calls[0].index == 0
    _weather_call(calls[0])
    assert all(not (ch.choices and ch.choices[0].delta.content) for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_call_cut_by_max_tokens_leaks_no_markup(oai):
    r = oai.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=5,
                                    temperature=0)
    c = r.choices[0]
    assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("length", "", None)
    assert r.usage.completion_tokens == 5
    chunks = list(oai.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required",
                                              max_tokens=5, temperature=0, stream=True))
    assert [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content] == []
    assert chunks[-1].choices[0].finish_reason == "length"


def test_auto_answers_content_or_calls_never_json(oai):
    r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                                    max_tokens=40, temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
    else:
        assert c.finish_reason in ("stop", "length")
        assert not c.message.content.lstrip().startswith("{")


def test_prompt_carries_tools_and_format(oai):
    def prompt_tokens(**kw) -> int:
        r = oai.chat.completions.create(model="x", messages=MSGS, max_tokens=1, temperature=0, **kw)
        return r.usage.prompt_tokens

    plain, listed = prompt_tokens(), prompt_tokens(tools=TOOLS[:1], tool_choice="required")
    assert listed > plain + 40  # the tool list and the answer's shape are in the system prompt
    assert prompt_tokens(tools=TOOLS[:1], tool_choice="none") < listed


def test_anthropic_any_and_tool(smollm2_server):
    a = anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="x", max_retries=0)
    atools = [{"name": "get_weather", "description": "Get the weather", "input_schema": WEATHER_PARAMS}]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = a.messages.create(model="x", max_tokens=200, messages=MSGS, tools=atools, tool_choice=choice)
        assert m.stop_reason == "tool_use"
        blocks = [b for b in m.content if b.type == "tool_use"]
        assert [b.name for b in blocks] == ["get_weather"] and blocks[0].input["city"] in ("Paris", "London")
        assert all(b.type == "tool_use" for b in m.content)
    with a.messages.stream(model="x", max_tokens=200, messages=MSGS, tools=atools,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True}) as st:
        final = st.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="x", max_tokens=60, messages=MSGS, tools=atools,
                          tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": "tool_choice.name: Tool 'nope' not found in tools"}


def test_vllm_parser_on_template_without_tools_logs(start_server):
    srv = start_server("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    assert "--tool-call-parser hermes: the chat template renders no tools" in srv.log()


def test_apply_template_shows_the_generic_system_text(smollm2_server):
    import httpx

    body = {"messages": MSGS, "tools": TOOLS[:1], "tool_choice": "required", "parallel_tool_calls": False}
    prompt = httpx.post(smollm2_server.url("/apply-template"), json=body, timeout=60).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou can call any of the following tools to satisfy the user's "
                             "requests: [\n  {\n    \"name\": \"get_weather\",")
    assert "\n\nRespond in JSON format with `tool_call` (a request to call tools)<|im_end|>\n" in prompt
    plain = httpx.post(smollm2_server.url("/apply-template"), json={"messages": MSGS}, timeout=60).json()["prompt"]
    assert "get_weather" not in plain

