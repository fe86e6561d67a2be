"""litellm's ``ollama/`` (``/api/generate``) and ``ollama_chat/`` (``/api/chat``) providers against
kvserve, plain and streamed (issue #13 item 4). litellm stays offline: its model cost map is
the bundled one (``LITELLM_LOCAL_MODEL_COST_MAP``) and telemetry is off."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
litellm = pytest.importorskip("litellm")

from test_ollama_client import Serve, make_home

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory):
    s = Serve(make_home(tmp_path_factory.mktemp("lhome"), smollm2_path), "-c", "2048", "-np", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("provider", ["ollama", "ollama_chat"])
def test_plain_and_streamed(srv, provider):
    kw = {"model": f"{provider}/smollm2", "messages": ASK, "api_base": srv.base_url, "temperature": 0, "max_tokens": 10}
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens == 10
    # ollama_chat maps done_reason; litellm's ollama/ (generate) provider always says "stop"
    assert r.choices[0].finish_reason == ("length" if provider == "ollama_chat" else "stop")
    chunks = list(litellm.completion(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
