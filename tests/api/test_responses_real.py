"""/v1/responses with the real SmolLM2 (slow): realistic answers through the official client,
openai-agents' default path and pydantic-ai's ``Agent("openai:...")``, on the shared server."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

G = {"temperature": 0}
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url("/v1"), api_key="x", max_retries=0, timeout=120)


def test_answer_and_a_follow_up_through_previous_response_id(client):
    r1 = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=20, **G)
    assert r1.status == "completed" and "Paris" in r1.output_text
    r2 = client.responses.create(model="smollm2", input="And the capital of Germany?", previous_response_id=r1.id,
                                 max_output_tokens=20, **G)
    assert "Berlin" in r2.output_text
    # the earlier turn came from the prefix cache: its prompt and answer (the answer's last token aside)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 2


def test_streamed_answer(client):
    with client.responses.stream(model="smollm2", input=QUESTION, max_output_tokens=20, **G) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "Paris" in "".join(deltas) == final.output_text


def test_pydantic_ai_default_agent(smollm2_server, monkeypatch):
    from pydantic_ai import Agent

    monkeypatch.setenv("OPENAI_BASE_URL", smollm2_server.url("/v1"))
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    result = Agent("openai:smollm2", model_settings={"temperature": 0, "max_tokens": 20}).run_sync(QUESTION)
    assert "Paris" in result.output


def test_openai_agents_default_agent(smollm2_server):
    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.models.openai_provider import OpenAIProvider

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=smollm2_server.url("/v1"), api_key="x",
                                                               max_retries=0, timeout=120))
    agent = Agent(name="geo", instructions="You are a helpful assistant.", model="smollm2",
                  model_settings=ModelSettings(temperature=0, max_tokens=20))
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=RunConfig(model_provider=provider,
                                                                          tracing_disabled=True)))
    assert "Paris" in result.final_output
