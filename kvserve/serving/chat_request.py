"""kvserve's own chat request: what every face builds from its wire types and the serving
layer plans (:func:`kvserve.serving.chat_plan.plan_chat`).

A face reads its dialect's JSON (field names, types, defaults, its error texts) into a
:class:`ChatRequest`; nothing here knows a dialect's field names or HTTP. Values are already
checked for type and range when a face hands the request on; what needs the loaded model (the
template, the vocabulary, the context size, the server's flags) is checked by the planner.

Messages and tool definitions keep the shape chat templates read (transformers'
``apply_chat_template`` convention, which Jinja chat templates are written for): a message is a
:class:`Message` whose ``content`` is a string, null or a list of :class:`TextPart`; a tool is a
:class:`ToolDefinition`. Their detailed checks (roles, part types, tool-call arguments) are the
renderer's (:func:`kvserve.chat.prompt.normalize_messages`), done once when the prompt is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Union

__all__ = ["ChatRequest", "Message", "ReasoningOptions", "StreamOptions", "TemplateOptions", "TextPart",
           "ToolCall", "ToolChoice", "ToolDefinition"]

class TextPart(TypedDict):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class ToolCallFunction(TypedDict, total=False):
    """The function a tool call names: ``arguments`` as a JSON object or its JSON text."""

    name: str
    arguments: Union[dict, str]


class ToolCall(TypedDict, total=False):
    """One call an assistant message made."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class Message(TypedDict, total=False):
    """One chat message as templates read it.

    ``role``: system, developer, user, assistant, tool, function or ipython
    (:data:`kvserve.chat.prompt.ROLES`); ``content``: text, null, or text parts;
    ``tool_calls`` (assistant), ``tool_call_id`` / ``name`` (a tool's answer),
    ``reasoning_content`` (the assistant's thinking).
    """

    role: str
    content: Union[str, None, list[TextPart]]
    tool_calls: list[ToolCall]
    tool_call_id: str
    name: str
    reasoning_content: str


class ToolDefinitionFunction(TypedDict, total=False):
    """A callable function: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict


class ToolDefinition(TypedDict, total=False):
    """One tool the model may call (``{"type": "function", "function": {...}}``)."""

    type: Literal["function"]
    function: ToolDefinitionFunction


#: ``"none"`` | ``"auto"`` | ``"required"`` | ``{"name": <function>}`` (that one function, once)
ToolChoice = Union[str, dict]


@dataclass(slots=True)
class ReasoningOptions:
    """How thinking is rendered, bounded and reported.

    Attributes:
        format: the reasoning split style asked for (``none``, ``auto``, ``deepseek``,
            ``deepseek-legacy``); None: the server's (``--reasoning-format``). Not used under a
            ``--reasoning-parser``.
        include: report the reasoning (under a ``--reasoning-parser``; else always).
        budget: thinking tokens before ``</think>`` is forced (-1: no limit); None: the server's
            ``--reasoning-budget``.
        effort: the template's ``reasoning_effort`` variable (None: not set).
    """

    format: str | None = None
    include: bool = True
    budget: int | None = None
    effort: str | None = None


@dataclass(slots=True)
class TemplateOptions:
    """How the conversation is rendered.

    Attributes:
        add_generation_prompt: append the assistant turn's header; None: the default (true).
        continue_final_message: continue the final message (True), never (False), or when it is
            the assistant's (None, llama-server's default).
        variables: the request's extra template variables (over the server's
            ``--chat-template-kwargs``); never the reserved ones.
        documents: RAG documents for the template (None: none).
        chat_template: the request's own Jinja chat template (vLLM's ``chat_template`` field,
            accepted only under ``--trust-request-chat-template``); None: the model's.
    """

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    variables: dict[str, Any] = field(default_factory=dict)
    documents: list[dict] | None = None
    chat_template: str | None = None


@dataclass(slots=True)
class StreamOptions:
    """Whether and how the answer streams.

    Attributes:
        stream: deliver the answer as it is generated.
        include_usage: end the stream with the token counts.
        return_progress: prompt-progress events before the first token (streams only).
    """

    stream: bool = False
    include_usage: bool = False
    return_progress: bool = False


@dataclass(slots=True)
class ChatRequest:
    """One chat request, as kvserve plans it (no dialect's field names).

    Attributes:
        messages: the conversation (:class:`Message` list, as the client sent it: the renderer
            checks it); the face has already put its own rules in (its system prompt, its roles).
        messages_may_be_empty: an empty ``messages`` renders the template's generation prompt
            alone (llama-server's Anthropic endpoint accepts it); False: 400 ``'messages' must not
            be empty``.
        request_id: the response's id; engine request k is ``<request_id>-<k>``.
        model: the model name the request gave ("" when none).
        keep_alive: seconds to keep the model loaded after this request, as the face read it
            (None: not given, or left to the model lease, which applies it before planning).
        tools: tool definitions (None: no tools).
        tool_choice: :data:`ToolChoice`; ``"auto"`` with tools, else ``"none"``, by default.
        parallel_tool_calls: allow more than one call per answer.
        response_format: the output constraint (a
            :class:`kvserve.structured.spec.ConstraintSpec`), None for free text.
        reasoning: :class:`ReasoningOptions`.
        template: :class:`TemplateOptions`.
        sampling: :class:`kvserve.engine.request.SamplingParams` fields the request sets (the rest
            are the model's defaults): temperature, top_k, stop strings, ``n_predict`` (the token
            limit; -1 none), seed, logit_bias (token id -> bias)...
        n_predict_is_default: ``sampling["n_predict"]`` is a bound, not a demand: the engine
            lowers it to the room the prompt leaves in the context instead of refusing the request
            (Ollama's ``num_predict`` from the model's layers; Anthropic's ``max_tokens``, a cap).
        n: choices per prompt (choice i samples with ``seed + i``).
        logprobs: top candidates to report per generated token (None: no logprobs).
        prompt_logprobs: candidates to report per prompt token (None: none); the prompt is then
            not reused from the cache.
        truncate_prompt_tokens: keep only the last k prompt tokens (None: keep all; a prompt that
            cannot fit is refused instead).
        stream: :class:`StreamOptions`.
        skip_special_tokens: hide control tokens in the text (the parsers' markers stay).
        spaces_between_special_tokens: accepted, no effect.
        id_slot: the slot to run in (-1: any).
        cache_salt: an extra key of the prefix cache's hashes (None: none).
        lora: the LoRA adapters to apply, ``(adapter id, scale)`` pairs (llama-server's per-request
            ``lora``, adapters not listed get 0); None or empty = the runner's global scales
            (``LoraRegistry.default_lora``). Checked by ``LoraRegistry.resolve`` when planned.
        owner: the caller's id (:attr:`kvserve.engine.request.Request.owner`).
        verbose: return the rendered prompt with the answer.
        token_ids: write logprobs tokens as ``token_id:N``.
    """

    messages: list[Message]
    request_id: str
    model: str = ""
    keep_alive: float | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = "none"
    parallel_tool_calls: bool = True
    response_format: Any = None
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    sampling: dict[str, Any] = field(default_factory=dict)
    n_predict_is_default: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    stream: StreamOptions = field(default_factory=StreamOptions)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    id_slot: int = -1
    cache_salt: str | None = None
    owner: str | None = None
    lora: Any = None
    messages_may_be_empty: bool = False
    verbose: bool = False
    token_ids: bool = False
