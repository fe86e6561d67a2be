"""One chat choice's generated text -> the assistant message's fields: ``content``, the
reasoning field and ``tool_calls`` (whole, and as streaming deltas).

The text goes through two stages:

1. reasoning split (:mod:`kvserve.chat.reasoning`): thinking between ``<think>`` and
   ``</think>`` goes to ``reasoning_content`` (llama-server, ``--reasoning-format``) or
   ``reasoning`` (vLLM, ``--reasoning-parser``);
2. tool-call parsing (:mod:`kvserve.chat.tool_calls`) of what is left: calls become
   ``tool_calls`` and the text before the first call stays ``content``.

A continued assistant message (``prefill``, e.g. ``"<tool_call>\\n"`` in seed 000 Example 13)
is part of the text the parsers see, but only newly generated text is returned as content,
as llama-server does.

Preserved tokens (:func:`preserved_token_ids`): the markers the active parsers read
(``ToolParser.marker_texts``, :func:`kvserve.chat.reasoning.reasoning_marker_texts`) that are one
control token of the vocabulary are rendered as text by the detokenizer while other control
tokens stay hidden (llama-server's ``preserved_tokens``). The parsers consume them; a marker no
parser consumes (malformed or unexpected output) stays in ``content`` as its text, as in
llama-server and in vLLM with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvserve.chat.reasoning import ReasoningStreamer, split_reasoning
from kvserve.chat.tool_parsers import get_tool_parser

__all__ = ["ChoiceOutput", "OutputMode", "marker_texts", "preserved_token_ids"]


@dataclass(frozen=True)
class OutputMode:
    """How a request's choices are post-processed.

    Attributes:
        tool_parser: parser name (``hermes``...) or None (no tool-call parsing).
        parallel_tool_calls: False keeps only the first call (vLLM/OpenAI semantics).
        reasoning_style: split style for :func:`kvserve.chat.reasoning.split_reasoning`
            (``deepseek``, ``deepseek-legacy``, ``deepseek_r1``, ``qwen3``) or None / ``none``.
        reasoning_field: ``reasoning_content`` (llama-server) or ``reasoning`` (vLLM).
        include_reasoning: False drops the reasoning from the response (vLLM's field).
        started_in_prompt: the generation prompt ended inside an opened ``<think>`` block.
        prompt_tail: the prompt's text after that ``<think>`` (llama-server parses it with the output).
        thinking_enabled: False when the request turned thinking off (``enable_thinking``).
        prefill: the continued final assistant message's content ("" when not continuing).
        tools: the request's OpenAI ``tools`` (the XML tool formats convert values by their
            parameter types).
        forced_tools: a grammar forces tool calls (``tool_choice`` required / a named function):
            whatever is not a whole call (a call cut by max_tokens) is dropped, never content.
    """

    tool_parser: str | None = None
    parallel_tool_calls: bool = True
    reasoning_style: str | None = None
    reasoning_field: str = "reasoning_content"
    include_reasoning: bool = True
    started_in_prompt: bool = False
    prompt_tail: str = ""
    thinking_enabled: bool = True
    prefill: str = ""
    tools: list | None = field(default=None, compare=False)
    forced_tools: bool = False

    @property
    def splits_reasoning(self) -> bool:
        """True when the text goes through a reasoning split (``none`` included: it may add the
        prompt's opened ``<think>`` back to the content)."""
        return self.reasoning_style is not None

    @property
    def active(self) -> bool:
        """False when the text is returned as it is (plain content)."""
        return self.tool_parser is not None or self.splits_reasoning


def marker_texts(mode: OutputMode) -> tuple[str, ...]:
    """The marker texts the mode's tool-call and reasoning parsers read (sorted, unique)."""
    from kvserve.chat.reasoning import reasoning_marker_texts
    from kvserve.chat.tool_parsers import TOOL_PARSERS

    texts: set[str] = set(reasoning_marker_texts(mode.reasoning_style))
    cls = TOOL_PARSERS.get(mode.tool_parser) if mode.tool_parser is not None else None
    if cls is not None:
        texts.update(cls.marker_texts, cls.anywhere_markers, cls.start_markers)
        if cls.close_marker:
            texts.add(cls.close_marker)
    return tuple(sorted(texts))


@functools.lru_cache(maxsize=256)
def _control_ids(tokenizer, texts: tuple[str, ...]) -> frozenset[int]:
    out = set()
    for t in texts:
        ids = tokenizer.encode(t, add_special=False, parse_special=True)
        if len(ids) == 1 and tokenizer.is_control(ids[0]):
            out.add(ids[0])
    return frozenset(out)


def preserved_token_ids(tokenizer, mode: OutputMode) -> frozenset[int]:
    """Token ids the detokenizer renders for this mode although they are control tokens.

    A marker counts when it tokenizes (special tokens parsed) to exactly one token and that
    token is a control token; markers of several tokens or of user-defined/normal tokens are
    rendered anyway (llama-server ``params_from_json_cmpl``: ``preserved_tokens`` with one
    token only). Empty when the mode parses nothing. Cached per (tokenizer, marker set).
    """
    if not mode.active:
        return frozenset()
    return _control_ids(tokenizer, marker_texts(mode))


class ChoiceOutput:
    """Post-processing state of one choice.

    Streaming: call :meth:`feed` with each text delta (one engine output) and :meth:`finish`
    at the end; both return OpenAI ``delta`` objects (``{"content": ...}``,
    ``{"<reasoning field>": ...}`` or ``{"tool_calls": [...]}``). Non-streaming: call
    :meth:`message` once with the whole text. Afterwards :attr:`has_tool_calls` says whether
    finish_reason becomes ``tool_calls`` and :attr:`reasoning_tokens` counts thinking tokens.
    """

    def __init__(self, mode: OutputMode):
        self.mode = mode
        self.has_tool_calls = False
        self.reasoning_tokens = 0
        self._reasoning = None
        self._tools = None
        self._n_calls = 0
        self._counter = None
        if mode.splits_reasoning:
            self._reasoning = self._new_reasoning()
        if mode.tool_parser is not None:
            # whole calls only: a call is sent once it closed and parsed, so a stream never
            # carries a call that the non-streamed answer drops (cut off by max_tokens, broken)
            self._tools = get_tool_parser(mode.tool_parser, tools=mode.tools).stream(incremental=False)
            if mode.prefill:
                self._tools.feed(mode.prefill)  # content fragments of the prefill are not new text

    def _new_reasoning(self) -> ReasoningStreamer:
        m = self.mode
        return ReasoningStreamer(style=m.reasoning_style, started_in_prompt=m.started_in_prompt,
                                 prompt_tail=m.prompt_tail, thinking_enabled=m.thinking_enabled)

    # -- streaming ------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        """Delta objects for one piece of generated text (may be empty: text held back)."""
        if not text:
            return []
        return self._stage2(self._stage1(self._reasoning.feed(text) if self._reasoning else [{"content": text}]))

    def finish(self) -> list[dict]:
        """Delta objects for the text still held back at the end of the choice."""
        out = self._stage1(self._reasoning.finish()) if self._reasoning else []
        deltas = self._stage2(out)
        if self._tools is not None:
            deltas += self._calls(self._tools.finish())
        return _merge(deltas)

    def _stage1(self, frags: list[dict]) -> list[dict]:
        """Reasoning fragments -> response field name; count thinking pieces."""
        out = []
        if self._reasoning is not None:
            self.reasoning_tokens = self._reasoning.reasoning_tokens
        for f in frags:
            if "reasoning" in f:
                if self.mode.include_reasoning and f["reasoning"]:
                    out.append({self.mode.reasoning_field: f["reasoning"]})
            elif f.get("content"):
                out.append({"content": f["content"]})
        return out

    def _stage2(self, frags: list[dict]) -> list[dict]:
        if self._tools is None:
            return frags
        out = []
        for f in frags:
            if "content" in f:
                out += self._calls(self._tools.feed(f["content"]))
            else:
                out.append(f)
        return out

    def _calls(self, frags: list[dict]) -> list[dict]:
        out = []
        for f in frags:
            if "tool_calls" in f:
                calls = []
                for c in f["tool_calls"]:
                    if c["index"] == 0 or self.mode.parallel_tool_calls:
                        calls.append(c)
                if calls:
                    self.has_tool_calls = True
                    out.append({"tool_calls": calls})
            elif f.get("content") and not self.mode.forced_tools:
                out.append(f)
        return out

    # -- whole message ----------------------------------------------------------------

    def count(self, text: str) -> None:
        """Non-streaming: follow one engine output's text only to count thinking tokens."""
        if self.mode.splits_reasoning and text:
            if self._counter is None:
                self._counter = self._new_reasoning()
            self._counter.feed(text)
            self.reasoning_tokens = self._counter.reasoning_tokens

    def message(self, text: str) -> dict:
        """The assistant message for the whole generated ``text`` (role, content, reasoning,
        tool_calls)."""
        msg: dict = {"role": "assistant"}
        content = text
        if self.mode.splits_reasoning:
            m = self.mode
            reasoning, content = split_reasoning(text, style=m.reasoning_style, started_in_prompt=m.started_in_prompt,
                                                 prompt_tail=m.prompt_tail, thinking_enabled=m.thinking_enabled)
            if reasoning is not None and self.mode.include_reasoning:
                msg[self.mode.reasoning_field] = reasoning
        if self.mode.tool_parser is not None:
            parser = get_tool_parser(self.mode.tool_parser, tools=self.mode.tools)
            full = self.mode.prefill + content
            res = parser.extract(full)
            if res.calls:
                calls = res.calls if self.mode.parallel_tool_calls else res.calls[:1]
                self.has_tool_calls = True
                content = (res.content or "")[len(self.mode.prefill):]  # only newly generated text
                msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments},
                                      "id": c.id} for c in calls]
            elif self.mode.forced_tools:
                content = ""  # a forced call cut off (max_tokens): dropped, its markup is no content
            elif parser.rewrites_content and not self.mode.prefill:
                content = res.content or ""  # harmony: the messages' text, as the stream sends it
        msg["content"] = content
        return msg


def _merge(deltas: list[dict]) -> list[dict]:
    """Join consecutive deltas of the same single text field (fewer SSE events)."""
    out: list[dict] = []
    for d in deltas:
        if out and len(d) == 1 and len(out[-1]) == 1:
            (k, v), (pk, pv) = next(iter(d.items())), next(iter(out[-1].items()))
            if k == pk and isinstance(v, str) and isinstance(pv, str):
                out[-1] = {k: pv + v}
                continue
        out.append(d)
    return out
