"""Wire types of the OpenAI face (:mod:`kvserve.faces.openai`): the response objects of
``/v1/chat/completions`` and the legacy ``/v1/completions``.

They follow OpenAI's API reference (the chat completion object, the chat completion chunk
object, the completion object) as llama-server writes them: seed 000 Example 4 (a chat
completion), 5 (stream chunks, the ``include_usage`` chunk) and 13 (``tool_calls``). Field
order is llama-server's (``choices`` first, ``id`` after ``usage`` in a whole response but after
``created`` in a chunk); llama.cpp adds ``timings`` (:class:`kvserve.faces.server_extensions.Timings`)
and writes its build string as ``system_fingerprint``. kvserve adds ``reasoning_content`` /
``reasoning`` (llama-server's and vLLM's reasoning field) to messages and deltas and
``usage.completion_tokens_details.reasoning_tokens`` when the reasoning is split.

Which keys are written: see :mod:`kvserve.faces.wire` (fields without a default always, e.g.
``finish_reason: null``; fields with a default only when given, e.g. a choice's ``logprobs``
only when the request asked for them). Build with the constructor, write with ``.wire()``.

Requests are not modelled here: they are read by :mod:`kvserve.faces.params` and the getters in
the face, because the contract includes llama-server's and vLLM's exact error texts and the order
fields are checked in (``top_logprobs requires logprobs to be set to true``, ``Field 'n': must
be between 1 and 128``), lenient shapes (a prompt is a string, ids, a list of either) and
defaults that come from the server's flags; a pydantic validation error would say something else.
"""

from __future__ import annotations

from typing import Literal

from pydantic import with_config
from typing_extensions import TypedDict

from kvserve.faces.server_extensions import PromptProgress, Timings
from kvserve.faces.wire import LEAF_CONFIG, WireModel

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "ChatTopLogprob",
    "CompletionTokensDetails",
    "FunctionCall",
    "FunctionCallDelta",
    "InputTokens",
    "LegacyLogprobs",
    "PromptLogprob",
    "PromptTokensDetails",
    "TextChoice",
    "TextCompletion",
    "TextCompletionChunk",
    "Timings",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
]


# -- usage ----------------------------------------------------------------------------------

class InputTokens(WireModel):
    """``POST /v1/chat/completions/input_tokens`` (llama-server's token counting route): the
    length in tokens of the prompt the same request to ``/v1/chat/completions`` would run."""

    input_tokens: int


class PromptTokensDetails(WireModel):
    """``usage.prompt_tokens_details``: prompt tokens served from the KV cache (always written,
    as llama-server does)."""

    cached_tokens: int


class CompletionTokensDetails(WireModel):
    """``usage.completion_tokens_details``: thinking tokens, written only when the request's
    reasoning is split from the content."""

    reasoning_tokens: int


class Usage(WireModel):
    """``usage``: token counts over all choices (a prompt's tokens counted once per prompt)."""

    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None
    estimated: bool | None = None  # kvserve: a remote model's upstream gave none: counted from the text


# -- logprobs -------------------------------------------------------------------------------

# TypedDicts, not models: 1 + top_logprobs of them per token (see kvserve.faces.wire).

@with_config(LEAF_CONFIG)
class ChatTopLogprob(TypedDict):
    """One candidate of a chat ``logprobs.content`` entry (natural log; -inf written -9999.0)."""

    token: str
    logprob: float
    bytes: list[int]


@with_config(LEAF_CONFIG)
class ChatTokenLogprob(TypedDict):
    """One chat ``logprobs.content`` entry: a sampled token, its logprob, UTF-8 bytes and the
    ``top_logprobs`` most likely candidates."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(WireModel):
    """A chat choice's ``logprobs``: ``{"content": [entries]}`` (the chunk's tokens in a stream)."""

    content: list[ChatTokenLogprob]


class LegacyLogprobs(WireModel):
    """The legacy completion ``logprobs`` object: four parallel lists, one entry per token.

    ``top_logprobs[i]`` maps candidate text -> logprob; ``token_logprobs[i]`` and
    ``top_logprobs[i]`` are null for the first prompt token under ``echo`` (nothing predicts it).
    ``text_offset[i]``: the token's character offset in the choice's text (echo included).
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@with_config(LEAF_CONFIG)
class PromptLogprob(TypedDict):
    """One candidate of a vLLM ``prompt_logprobs`` entry: natural log (-inf written -9999.0),
    ``rank`` (1 = the most likely; null when unknown) and the token's text."""

    logprob: float
    rank: int | None
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token, token id (as a string) -> candidate; null first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# -- tool calls -----------------------------------------------------------------------------

class FunctionCall(WireModel):
    """``tool_calls[i].function`` of a whole message: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(WireModel):
    """One ``message.tool_calls`` entry (kvserve's order: type, function, id)."""

    type: Literal["function"]
    function: FunctionCall
    id: str


class FunctionCallDelta(WireModel):
    """``tool_calls[i].function`` of a delta: the name in a call's first fragment, then
    ``arguments`` text to append."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(WireModel):
    """One ``delta.tool_calls`` entry: ``index`` numbers the calls; ``id`` and ``type`` come in a
    call's first fragment (kvserve sends each call whole, as one fragment)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


# -- chat -----------------------------------------------------------------------------------

class ChatMessage(WireModel):
    """The assistant ``message`` of a whole chat choice. At most one of ``reasoning_content``
    (llama-server) and ``reasoning`` (vLLM) is written, and only when the reasoning is split."""

    role: str  # "assistant", or vLLM's --response-role / the last message's role (kvserve.faces.openai)
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    content: str | None


class ChatChoice(WireModel):
    """One choice of a chat completion. ``finish_reason``: ``stop``, ``length`` or ``tool_calls``;
    ``logprobs`` only when the request set ``logprobs``."""

    finish_reason: str
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletion(WireModel):
    """A whole chat completion (``object: chat.completion``, seed 000 Example 4 field order)."""

    choices: list[ChatChoice]
    created: int
    model: str
    system_fingerprint: str
    object: Literal["chat.completion"]
    usage: Usage
    id: str
    timings: Timings
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asked for them


class ChatDelta(WireModel):
    """A chunk's ``delta``: the first chunk of a choice is ``{"role": "assistant", "content":
    null}``, each later one carries one field (``content``, the reasoning field or
    ``tool_calls``), the finish chunk none (``{}``)."""

    role: str | None = None  # the first chunk's: see ChatMessage.role
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(WireModel):
    """One choice of a chat chunk: ``finish_reason`` null until the finish chunk; ``logprobs``
    (the tokens of this chunk) only when the request set ``logprobs`` and there are some."""

    finish_reason: str | None
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(WireModel):
    """One SSE event of a streamed chat completion (seed 000 Example 5 field order). ``timings``
    on a choice's finish chunk; with ``stream_options.include_usage`` a last chunk with
    ``choices: []``, ``usage`` and ``timings``."""

    choices: list[ChatChunkChoice]
    created: int
    id: str
    model: str
    system_fingerprint: str
    object: Literal["chat.completion.chunk"]
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_progress: PromptProgress | None = None  # llama-server's return_progress (before the first token)


# -- legacy completions ---------------------------------------------------------------------

class TextChoice(WireModel):
    """One choice of a legacy completion (whole or chunk). ``logprobs`` is always written: null
    when the request did not ask for them (and on a finish chunk with no tokens left)."""

    finish_reason: str | None
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asked for them


class TextCompletion(WireModel):
    """A whole legacy completion (``object: text_completion``; the chat completion's field order)."""

    choices: list[TextChoice]
    created: int
    model: str
    system_fingerprint: str
    object: Literal["text_completion"]
    usage: Usage
    id: str
    timings: Timings


class TextCompletionChunk(WireModel):
    """One SSE event of a streamed legacy completion (the chat chunk's envelope, ``object`` is
    ``text_completion`` as in OpenAI's API)."""

    choices: list[TextChoice]
    created: int
    id: str
    model: str
    system_fingerprint: str
    object: Literal["text_completion"]
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_progress: PromptProgress | None = None  # llama-server's return_progress (before the first token)
