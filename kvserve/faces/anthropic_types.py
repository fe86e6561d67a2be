"""Wire types of the Anthropic face (:mod:`kvserve.faces.anthropic`): the objects
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` answer with.

They follow Anthropic's Messages API reference and the official ``anthropic`` client's types
(``anthropic.types.Message``, ``Usage``, ``TextBlock``, ``ThinkingBlock``, ``ToolUseBlock``, the
``Raw*Event`` stream events): a message object ``{"id", "type": "message", "role":
"assistant", "model", "content": [blocks], "stop_reason", "stop_sequence", "usage"}`` in the
order Anthropic writes its keys, the stream events ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` (``text_delta``, ``input_json_delta``, ``thinking_delta``,
``signature_delta``), ``content_block_stop``, ``message_delta``, ``message_stop``, and the
error envelope ``{"type": "error", "error": {"type", "message"}}``.

``usage`` follows llama-server's Anthropic endpoint and Anthropic's rule that the prompt is
``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``: prompt tokens read
from the prefix cache are ``cache_read_input_tokens``, the prompt tokens computed are
``input_tokens``; kvserve caches every prompt automatically (no ``cache_control``
breakpoints), so ``cache_creation_input_tokens`` is always 0.

Which keys are written: :mod:`kvserve.faces.wire`; every field here has no default, so every
key is always written (``stop_sequence: null`` included) and ``type`` is given explicitly. Requests
are not modelled here: :mod:`kvserve.faces.anthropic` reads them into the OpenAI face's chat
request, with errors naming the field the way Anthropic's API does (``messages.0.content.1``).
"""

from __future__ import annotations

from typing import Any, Literal

from kvserve.faces.wire import WireModel

__all__ = [
    "AnthropicError",
    "ContentBlockDelta",
    "ContentBlockStart",
    "ContentBlockStop",
    "CountTokens",
    "ErrorDetail",
    "InputJsonDelta",
    "Message",
    "MessageDelta",
    "MessageDeltaBody",
    "MessageStart",
    "MessageStop",
    "Ping",
    "SignatureDelta",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingDelta",
    "ToolUseBlock",
    "Usage",
]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class Usage(WireModel):
    """``usage`` (tokens): ``input_tokens`` computed for the prompt, prompt tokens read from the
    prefix cache, none written to a cache by request (always 0), tokens generated."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


# -- content blocks -------------------------------------------------------------------------

class TextBlock(WireModel):
    """``{"type": "text", "text"}``."""

    type: Literal["text"]
    text: str


class ThinkingBlock(WireModel):
    """``{"type": "thinking", "thinking", "signature"}``: the model's reasoning (what the
    reasoning parser split off). ``signature`` is empty: nothing verifies it here."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseBlock(WireModel):
    """``{"type": "tool_use", "id", "name", "input"}``: one tool call, ``input`` the arguments
    object (``{}`` in a stream's ``content_block_start``, then ``input_json_delta``s)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


Block = TextBlock | ThinkingBlock | ToolUseBlock


class Message(WireModel):
    """The message object: a whole answer, or (empty ``content``, null ``stop_reason``) the one
    in ``message_start``."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Block]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class CountTokens(WireModel):
    """``POST /v1/messages/count_tokens``: the rendered prompt's length in tokens."""

    input_tokens: int


# -- stream events ----------------------------------------------------------------------------

class MessageStart(WireModel):
    """``message_start``: the message with no content yet and the prompt's usage."""

    type: Literal["message_start"]
    message: Message


class ContentBlockStart(WireModel):
    """``content_block_start``: block ``index`` opens (text ``""``, thinking ``""``, tool_use
    with ``input: {}``)."""

    type: Literal["content_block_start"]
    index: int
    content_block: Block


class TextDelta(WireModel):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(WireModel):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(WireModel):
    type: Literal["signature_delta"]
    signature: str


class InputJsonDelta(WireModel):
    """A piece of a tool call's arguments as JSON text (the pieces joined parse to ``input``)."""

    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(WireModel):
    """``content_block_delta``: more of block ``index``."""

    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(WireModel):
    type: Literal["content_block_stop"]
    index: int


class MessageDeltaBody(WireModel):
    """``message_delta.delta``: why generation stopped."""

    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(WireModel):
    """``message_delta``: the stop reason and the final (cumulative) usage."""

    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: Usage


class MessageStop(WireModel):
    type: Literal["message_stop"]


class Ping(WireModel):
    type: Literal["ping"]


# -- errors -----------------------------------------------------------------------------------

class ErrorDetail(WireModel):
    """``error``: one of Anthropic's types (invalid_request_error, authentication_error,
    not_found_error, request_too_large, overloaded_error, api_error) and a message."""

    type: str
    message: str


class AnthropicError(WireModel):
    """The error envelope (also the ``error`` stream event after a stream began)."""

    type: Literal["error"]
    error: ErrorDetail
