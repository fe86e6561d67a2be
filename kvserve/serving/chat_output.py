"""One chat choice's generated text -> the answer's parts: text, reasoning and tool calls,
whole (:class:`Answer`) and as streamed pieces (:class:`TextPiece`, :class:`ReasoningPiece`,
:class:`ToolCallPiece`). Faces write these in their dialect (OpenAI's ``content`` /
``reasoning_content`` / ``tool_calls``, Anthropic's content blocks, Ollama's ``message``).

The text goes through two stages:

1. reasoning split (:mod:`kvserve.chat.reasoning`): thinking between ``<think>`` and
   ``</think>`` becomes reasoning (llama-server's ``--reasoning-format``, vLLM's
   ``--reasoning-parser``);
2. tool-call parsing (:mod:`kvserve.chat.tool_calls`) of what is left: calls become tool calls
   and the text before the first call stays text.

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

__all__ = ["Answer", "ChoiceOutput", "OutputMode", "Piece", "ReasoningPiece", "TextPiece", "ToolCallPiece",
           "marker_texts", "preserved_token_ids"]


@dataclass(slots=True)
class TextPiece:
    """New answer text of one step (what the user reads)."""

    text: str


@dataclass(slots=True)
class ReasoningPiece:
    """New reasoning (thinking) text of one step."""

    text: str


@dataclass(slots=True)
class ToolCallPiece:
    """One whole tool call (sent once it closed and parsed, never in parts).

    Attributes:
        index: the call's number in the choice (0, 1, ...).
        id: the call's id (the parser's, e.g. ``functions.read_file:0``, or a made one).
        name: the function's name.
        arguments: the arguments as JSON text, as the model wrote them (parsers normalize some).
    """

    index: int
    id: str
    name: str
    arguments: str


#: one streamed piece of a choice's answer
Piece = TextPiece | ReasoningPiece | ToolCallPiece


@dataclass(slots=True)
class Answer:
    """A choice's whole answer (non-streaming).

    Attributes:
        text: the answer text ("" when none).
        reasoning: the reasoning text; None when the reasoning is not split out or is dropped
            (``include_reasoning`` false), "" when split and empty.
        tool_calls: the calls, in order (``index`` 0, 1, ...).
    """

    text: str
    reasoning: str | None = None
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


@dataclass(frozen=True)
class OutputMode:
    """How a request's choices are post-processed.

    Attributes:
        tool_parser: parser name (``hermes``...) or None (no tool-call parsing).
        parallel_tool_calls: False keeps only the first call (vLLM/OpenAI semantics).
        reasoning_style: split style for :func:`kvserve.chat.reasoning.split_reasoning`
            (``deepseek``, ``deepseek-legacy``, ``deepseek_r1``, ``qwen3``) or None / ``none``.
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
    at the end; both return :data:`Piece` s (one text piece per parser fragment; ``finish`` joins
    consecutive text, and consecutive reasoning, pieces).
    Non-streaming: call :meth:`count` with each text delta and :meth:`answer` once with the
    whole text. Afterwards :attr:`has_tool_calls` says whether the choice called tools and
    :attr:`reasoning_tokens` counts thinking tokens.

    Internally the :mod:`kvserve.chat` parsers' fragments (``{"content"}``, ``{"reasoning"}``,
    their tool-call fragments) are read and turned into pieces here.
    """

    def __init__(self, mode: OutputMode):
        self.mode = mode
        self.has_tool_calls = False
        self.reasoning_tokens = 0
        self._reasoning = None
        self._tools = None
        self._counter = None
        self._prefill_left = 0  # characters of the prefill the tool parser still holds back
        if mode.splits_reasoning:
            self._reasoning = self._new_reasoning()
        if mode.tool_parser is not None:
            # whole calls only: a call is sent once it closed and parsed, so a stream never
            # carries a call that the non-streamed answer drops (cut off by max_tokens, broken)
            parser = get_tool_parser(mode.tool_parser, tools=mode.tools)
            self._tools = parser.stream(incremental=False)
            if mode.prefill:  # content fragments of the prefill are not new text
                sent = sum(len(f.get("content") or "") for f in self._tools.feed(mode.prefill))
                if not parser.rewrites_content:
                    # what it holds back (a call's opening, trailing space) comes out as content
                    # later, before the new text, unless it becomes a call
                    self._prefill_left = len(mode.prefill) - sent

    def _new_reasoning(self) -> ReasoningStreamer:
        m = self.mode
        return ReasoningStreamer(style=m.reasoning_style, started_in_prompt=m.started_in_prompt,
                                 prompt_tail=m.prompt_tail, thinking_enabled=m.thinking_enabled)

    # -- streaming ------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        """Pieces for one piece of generated text (may be empty: text held back)."""
        if not text:
            return []
        return self._stage2(self._stage1(self._reasoning.feed(text) if self._reasoning else [TextPiece(text)]))

    def finish(self) -> list[Piece]:
        """Pieces for the text still held back at the end of the choice."""
        out = self._stage1(self._reasoning.finish()) if self._reasoning else []
        pieces = self._stage2(out)
        if self._tools is not None:
            pieces += self._calls(self._tools.finish())
        return _merge(pieces)

    def _stage1(self, frags: list) -> list[Piece]:
        """Reasoning fragments -> pieces; count thinking pieces. (Without a reasoning split the
        text comes as pieces already.)"""
        if self._reasoning is None:
            return frags
        out: list[Piece] = []
        self.reasoning_tokens = self._reasoning.reasoning_tokens
        for f in frags:
            if "reasoning" in f:
                if self.mode.include_reasoning and f["reasoning"]:
                    out.append(ReasoningPiece(f["reasoning"]))
            elif f.get("content"):
                out.append(TextPiece(f["content"]))
        return out

    def _stage2(self, pieces: list[Piece]) -> list[Piece]:
        """Text pieces through the tool-call parser (when there is one)."""
        if self._tools is None:
            return pieces
        out: list[Piece] = []
        for p in pieces:
            if type(p) is TextPiece:
                out += self._calls(self._tools.feed(p.text))
            else:
                out.append(p)
        return out

    def _calls(self, frags: list[dict]) -> list[Piece]:
        """The tool-call parser's fragments -> pieces (only the first call unless parallel)."""
        out: list[Piece] = []
        for f in frags:
            if "tool_calls" in f:
                for c in f["tool_calls"]:
                    if c["index"] == 0 or self.mode.parallel_tool_calls:
                        fn = c["function"]
                        out.append(ToolCallPiece(c["index"], c["id"], fn["name"], fn["arguments"]))
                        self.has_tool_calls = True
                self._prefill_left = 0  # the held-back prefill was the call's opening
            elif f.get("content") and not self.mode.forced_tools:
                text = f["content"]
                if self._prefill_left:  # released prefill text: not new, as the whole answer says
                    cut = min(self._prefill_left, len(text))
                    text, self._prefill_left = text[cut:], self._prefill_left - cut
                if text:
                    out.append(TextPiece(text))
        return out

    # -- whole message ----------------------------------------------------------------

    def count(self, text: str) -> None:
        """Non-streaming: follow one engine output's text only to count thinking tokens."""
        if self.mode.splits_reasoning and text:
            if self._counter is None:
                self._counter = self._new_reasoning()
            self._counter.feed(text)
            self.reasoning_tokens = self._counter.reasoning_tokens

    def answer(self, text: str) -> Answer:
        """The whole answer for the whole generated ``text`` (text, reasoning, tool calls)."""
        ans = Answer(text)
        content = text
        m = self.mode
        if m.splits_reasoning:
            reasoning, content = split_reasoning(text, style=m.reasoning_style, started_in_prompt=m.started_in_prompt,
                                                 prompt_tail=m.prompt_tail, thinking_enabled=m.thinking_enabled)
            if reasoning is not None and m.include_reasoning:
                ans.reasoning = reasoning
        if m.tool_parser is not None:
            parser = get_tool_parser(m.tool_parser, tools=m.tools)
            res = parser.extract(m.prefill + content)
            if res.calls:
                calls = res.calls if m.parallel_tool_calls else res.calls[:1]
                self.has_tool_calls = True
                content = (res.content or "")[len(m.prefill):]  # only newly generated text
                ans.tool_calls = [ToolCallPiece(k, c.id, c.name, c.arguments) for k, c in enumerate(calls)]
            elif m.forced_tools:
                content = ""  # a forced call cut off (max_tokens): dropped, its markup is no content
            elif parser.rewrites_content and not m.prefill:
                content = res.content or ""  # harmony: the messages' text, as the stream sends it
        ans.text = content
        return ans


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join consecutive text pieces, and consecutive reasoning pieces (fewer events)."""
    out: list[Piece] = []
    for p in pieces:
        if out and type(p) is type(out[-1]) and type(p) is not ToolCallPiece:
            out[-1] = type(p)(out[-1].text + p.text)
            continue
        out.append(p)
    return out
