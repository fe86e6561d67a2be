"""The Anthropic face's request side as llama-server converts it (issue 32, Build 1: the Anthropic
details of llama.cpp's tools/server/tests/unit/test_compat_anthropic.py):

- an empty ``messages`` list is accepted: the template renders no turn (the test template its
  default system turn) and the generation prompt, after ``system`` when given, as llama-server;
- ``thinking`` blocks of an assistant turn become its ``reasoning_content``, which the chat
  template renders in its reasoning markup (Qwen 3's ``<think>``), so ``count_tokens`` grows by
  exactly the tokens of that markup;
- an ``image`` block (in a turn or in a ``tool_result``) on a text-only model is llama-server's
  500 ``image input is not supported - hint: ...``, in Anthropic's envelope.

Token counts are compared with the prompt rendered here from the OpenAI-style messages the
conversion must produce (:func:`kvserve.chat.prompt.render_chat`, the same template and tokenizer):
a count that matches is the same prompt. The model is the tiny random GGUF (tests/tinymodel.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvserve.chat.prompt import normalize_messages, render_chat
from kvserve.chat.template import ChatTemplate
from kvserve.errors import InvalidInputError
from kvserve.faces.anthropic import NO_IMAGE_INPUT, chat_request
from kvserve.faces.api_error import ApiError
from kvserve.loaders.tokenizer import Tokenizer

QWEN3 = Path(__file__).resolve().parents[1] / "templates" / "vendor" / "Qwen-Qwen3-0.6B.jinja"
HERMES = Path(__file__).resolve().parents[1] / "templates" / "hermes_tools.jinja"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
THOUGHT = "I should check the project structure first."

LIST_FILES = {"name": "list_files", "description": "List files",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
LIST_FILES_OPENAI = {"type": "function", "function": {"name": "list_files", "description": "List files",
                                                      "parameters": LIST_FILES["input_schema"]}}
CALL = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}]}


def history(*assistant_blocks: dict) -> list[dict]:
    return [{"role": "user", "content": "Fix the bug"}, {"role": "assistant", "content": list(assistant_blocks)},
            RESULT]


def openai_history(reasoning: str | None) -> list[dict]:
    """What :func:`history` must become (the OpenAI-style messages the template renders)."""
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": {"path": "."}}}]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [{"role": "user", "content": "Fix the bug"}, assistant,
            {"role": "tool", "tool_call_id": "call_1", "content": "main.py"}]


# ------------------------------------------------------------------------ no server


def test_thinking_blocks_become_reasoning_content():
    body = {"max_tokens": 5, "messages": history({"type": "thinking", "thinking": THOUGHT, "signature": "s"},
                                                 {"type": "redacted_thinking", "data": "opaque"},
                                                 {"type": "thinking", "thinking": "Then read main.py."}, CALL)}
    assert chat_request(body).messages == openai_history(f"{THOUGHT}\nThen read main.py.")
    only_redacted = {"max_tokens": 5, "messages": history({"type": "redacted_thinking", "data": "x"}, CALL)}
    assert chat_request(only_redacted).messages == openai_history(None)


def test_thinking_block_needs_its_text():
    body = {"max_tokens": 5, "messages": history({"type": "thinking", "signature": "s"}, CALL)}
    with pytest.raises(ApiError) as e:
        chat_request(body)
    assert (e.value.status, e.value.message) == (400, "messages.1.content.0.thinking: Field required")


def test_empty_messages_is_a_request():
    req = chat_request({"max_tokens": 5, "messages": []})
    assert (req.messages, req.messages_may_be_empty) == ([], True)
    assert chat_request({"messages": [], "system": "Be brief."}, counting=True).messages == [
        {"role": "system", "content": "Be brief."}]
    with pytest.raises(ApiError) as e:  # the field itself is still required
        chat_request({"max_tokens": 5})
    assert (e.value.status, e.value.message) == (400, "messages: Field required")


def test_renderer_refuses_empty_messages_unless_allowed():
    assert normalize_messages([], allow_empty=True) == []
    with pytest.raises(InvalidInputError, match="'messages' must not be empty"):
        normalize_messages([])


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": [CALL]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                   "content": [{"type": "text", "text": "File: test.png"}, IMAGE]}]}],
])
def test_image_is_llama_servers_500(messages):
    with pytest.raises(ApiError) as e:
        chat_request({"max_tokens": 5, "messages": messages})
    assert (e.value.status, e.value.message) == (500, NO_IMAGE_INPUT)
    assert NO_IMAGE_INPUT == ("image input is not supported - hint: if this is unexpected, you may need to "
                              "provide the mmproj")


# ------------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def tok(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(tiny_gguf)


@pytest.fixture(scope="module")
def qwen3(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(QWEN3), "-np", "1", "-c", "2048", "-a", "tiny",
                               model=tiny_gguf)


@pytest.fixture(scope="module")
def hermes(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(HERMES), "-np", "1", "-c", "2048", "-a", "tiny",
                               model=tiny_gguf)


def count(srv, **body) -> int:
    r = httpx.post(srv.url("/v1/messages/count_tokens"), json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert list(r.json()) == ["input_tokens"]
    return r.json()["input_tokens"]


def rendered(path: Path, tok: Tokenizer, messages: list[dict], tools=None) -> tuple[str, int]:
    template = ChatTemplate(path.read_text(), tok.bos_token, tok.eos_token)
    text, ids = render_chat(template, tok, messages, tools=tools, allow_empty=True)
    return text, len(ids)


def test_thinking_history_is_rendered_as_reasoning(qwen3, tok):
    """llama.cpp's test_anthropic_thinking_history_in_count_tokens, with exact counts: the
    thinking block is Qwen 3's ``<think>`` block of that turn (after the last user query)."""
    without = count(qwen3, messages=history(CALL), tools=[LIST_FILES])
    with_thinking = count(qwen3, messages=history({"type": "thinking", "thinking": THOUGHT, "signature": ""}, CALL),
                          tools=[LIST_FILES])
    text, n = rendered(QWEN3, tok, openai_history(THOUGHT), [LIST_FILES_OPENAI])
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n<tool_call>" in text
    assert with_thinking == n
    assert without == rendered(QWEN3, tok, openai_history(None), [LIST_FILES_OPENAI])[1]
    assert with_thinking > without


def test_empty_messages_render_the_generation_prompt(hermes, tok):
    text, n = rendered(HERMES, tok, [])
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n"
    assert count(hermes, messages=[]) == n
    sys_text, sys_n = rendered(HERMES, tok, [{"role": "system", "content": "Be brief."}])
    assert sys_text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
    assert count(hermes, messages=[], system="Be brief.") == sys_n
    r = httpx.post(hermes.url("/v1/messages"), json={"model": "tiny", "max_tokens": 3, "messages": [],
                                                     "temperature": 0, "cache_prompt": False}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["type"], body["role"], body["stop_reason"]) == ("message", "assistant", "max_tokens")
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == n
    assert body["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_image_on_a_text_model_is_a_500(hermes, path, stream):
    """llama.cpp's test_anthropic_vision_format_accepted and test_anthropic_tool_result_with_image:
    llama-server's status and message, in Anthropic's envelope (a stream that never started
    answers as a plain error)."""
    body = {"model": "tiny", "max_tokens": 10, "stream": stream,
            "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]}]}
    r = httpx.post(hermes.url(path), json=body, timeout=60)
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": NO_IMAGE_INPUT}}
