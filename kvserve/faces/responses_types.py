"""Wire types of OpenAI's Responses API face (:mod:`kvserve.faces.responses`): the response
object, its output items and the typed SSE events of ``stream: true``.

Shapes and field order follow OpenAI's API reference (the response object, the streaming
events) and the official ``openai`` client's types (``openai.types.responses``): ``type``
first in items and events, then ``sequence_number`` on each event. Which keys are written:
see :mod:`kvserve.faces.wire` (fields without a default always, ``null`` included).

Requests are not modelled here: :mod:`kvserve.faces.responses` reads them with the shared
getters, so that errors name the field (``input[2].call_id``) as the other faces do.
"""

from __future__ import annotations

from typing import Any, Literal

from kvserve.faces.wire import WireModel

__all__ = [
    "ContentPartAdded",
    "ContentPartDone",
    "DeletedResponse",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "FunctionCallItem",
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputMessage",
    "OutputText",
    "OutputTextDelta",
    "OutputTextDone",
    "OutputTokensDetails",
    "ReasoningItem",
    "ReasoningText",
    "ReasoningTextDelta",
    "ReasoningTextDone",
    "Response",
    "ResponseError",
    "ResponseLifecycle",
    "ResponseUsage",
]

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# -- usage ----------------------------------------------------------------------------------

class InputTokensDetails(WireModel):
    """``usage.input_tokens_details``: input tokens served from the prefix cache
    (``cached_tokens``) and written to a cache (``cache_write_tokens``: always 0, kvserve
    caches every prompt without charging for it; the ``openai`` client's type requires the field)."""

    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(WireModel):
    """``usage.output_tokens_details``: output tokens spent in the thinking block (0 when the
    reasoning is not split)."""

    reasoning_tokens: int


class ResponseUsage(WireModel):
    """``usage``: token counts of the one generation (prompt = ``input_tokens``)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


# -- output items ---------------------------------------------------------------------------

class OutputText(WireModel):
    """An ``output_text`` content part of a message (no annotations: kvserve cites nothing)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(WireModel):
    """A ``reasoning_text`` content part: the model's thinking, as it wrote it."""

    type: Literal["reasoning_text"]
    text: str


class OutputMessage(WireModel):
    """An assistant ``message`` output item (``status`` incomplete when cut by max_output_tokens)."""

    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(WireModel):
    """A ``function_call`` output item: ``arguments`` is JSON text, ``call_id`` is what the
    client's ``function_call_output`` names."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningItem(WireModel):
    """A ``reasoning`` output item. ``summary`` stays empty (kvserve writes no summaries); the
    thinking text is in ``content`` (``reasoning_text`` parts), as vLLM and gpt-oss write it."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


# -- the response ---------------------------------------------------------------------------

class IncompleteDetails(WireModel):
    """Why a response is ``incomplete`` (kvserve: only ``max_output_tokens``)."""

    reason: str


class ResponseError(WireModel):
    """``error`` of a ``failed`` response."""

    code: str
    message: str


class Response(WireModel):
    """The response object (``object: response``), in OpenAI's field order. The request's
    settings are echoed (``tools`` in the Responses shape, ``text.format``, ``reasoning``);
    ``usage`` is null until the response finished."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(WireModel):
    """The answer to ``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"]
    deleted: bool


class ResponseInputTokens(WireModel):
    """The answer to ``POST /v1/responses/input_tokens`` (OpenAI's and llama-server's token
    counting route): the length in tokens of the prompt the same request to ``/v1/responses``
    would run."""

    object: Literal["response.input_tokens"]
    input_tokens: int


# -- streaming events -----------------------------------------------------------------------

class ResponseLifecycle(WireModel):
    """``response.created``, ``response.in_progress``, ``response.completed``,
    ``response.incomplete`` and ``response.failed``: the whole response as it is now."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: Response


class OutputItemAdded(WireModel):
    """``response.output_item.added``: an item starts (empty text/arguments, in_progress)."""

    type: Literal["response.output_item.added"]
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(WireModel):
    """``response.output_item.done``: the finished item, as it is in the final response."""

    type: Literal["response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(WireModel):
    """``response.content_part.added``: a message's ``output_text`` (or a reasoning item's
    ``reasoning_text``) part starts, with empty text."""

    type: Literal["response.content_part.added"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(WireModel):
    """``response.content_part.done``: the part with its whole text."""

    type: Literal["response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(WireModel):
    """``response.output_text.delta``: text to append (``logprobs`` always empty)."""

    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDone(WireModel):
    """``response.output_text.done``: the part's whole text."""

    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ReasoningTextDelta(WireModel):
    """``response.reasoning_text.delta``: thinking text to append."""

    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(WireModel):
    """``response.reasoning_text.done``: the whole thinking text of the part."""

    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(WireModel):
    """``response.function_call_arguments.delta``: arguments text to append (kvserve sends a
    call's arguments whole, in one delta, once the call parsed)."""

    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(WireModel):
    """``response.function_call_arguments.done``: the call's whole arguments text."""

    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
