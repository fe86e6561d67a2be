"""Reasoning ("thinking") output: split it from the answer, stream it, and cap its length.

Styles of :func:`split_reasoning` and :class:`ReasoningStreamer`:

``deepseek_r1`` (vLLM ``--reasoning-parser deepseek_r1``, seed 002 Example 12)
    No end tag: no reasoning (``None``), all text is content, unchanged. With an end tag: the
    text before it is reasoning (after a ``<think>`` when there is one), the text after it is
    content; both stripped of surrounding whitespace, as the seed's outputs are.
``qwen3`` (vLLM ``--reasoning-parser qwen3``, current vLLM)
    A ``<think>`` in the output is skipped. With an end tag: split as above (stripped). Without
    one the output was cut while thinking, so it is all reasoning and content is ``""``;
    with ``thinking_enabled=False`` (``chat_template_kwargs.enable_thinking``) it is all content.
``kimi_k2`` (vLLM)
    ``deepseek_r1`` under Kimi's name (vLLM registers ``DeepSeekR1ReasoningParser`` for it).
``deepseek_v3`` (vLLM ``DeepSeekV3ReasoningParser``)
    ``deepseek_r1`` when thinking is on, else no split (all content, reasoning ``None``). vLLM
    turns thinking on only with ``chat_template_kwargs`` ``thinking``/``enable_thinking`` true;
    here thinking is on unless the request turned ``enable_thinking`` off (the V3.1 templates
    close the block in the prompt when it is off, so the output has no ``</think>`` to split).
``glm45`` (vLLM ``Glm4MoeModelReasoningParser``) and ``granite`` (``GraniteReasoningParser``)
    Thinking only when the output opens (after whitespace) with the start marker (``<think>``;
    ``Here is my thought process:`` / ``Here's my thought process:``) and is closed by the end
    marker (``</think>``; ``Here is my response:`` / ``Here's my response:``); both parts are
    stripped. Without both markers all text is content and reasoning is ``None`` (vLLM); a
    start marker that never closes streams as reasoning. ``glm45`` when the prompt opened
    ``<think>`` (templates that end the generation prompt with it): ``deepseek_r1``'s split. vLLM also drops text before a start
    marker found later in the text; here such text is content.
``mistral`` (vLLM ``MistralReasoningParser``)
    ``[THINK]...[/THINK]`` at the start, split as ``glm45``; an unclosed ``[THINK]`` is all
    reasoning (vLLM too). vLLM also takes a ``[THINK]`` after some text (that text is content);
    here only a leading one opens thinking.
``minimax_m2``, ``step3``, ``seed_oss`` (vLLM ``BaseThinkingReasoningParser`` family)
    ``qwen3``'s split (no end tag: all reasoning), with ``<seed:think>``/``</seed:think>`` for
    ``seed_oss``. ``minimax_m2_append_think``: no split; content is ``"<think>"`` + the output.
``openai_gptoss`` (vLLM's gpt-oss harmony path)
    ``analysis`` messages are reasoning (several joined by ``"\n"``), ``final`` and
    recipient-less ``commentary`` messages are content, a ``functions.NAME`` message stays in
    the content as its harmony text for ``--tool-call-parser openai``
    (:mod:`kvserve.chat.harmony`). Stream and split agree (the split joins the stream).
``deepseek`` (llama-server ``--reasoning-format deepseek``/``auto``, seed 000 Example 14)
    Thinking is open when the prompt ended inside ``<think>`` (``started_in_prompt``; the
    prompt's text after that tag, ``prompt_tail``, belongs to the reasoning, as llama-server
    parses generation prompt + output) or when the output starts with ``<think>``. Then all
    text up to ``</think>`` is reasoning, unfinished or not, unstripped; the content after
    the tag loses its leading whitespace. Otherwise all text is content.
``deepseek-legacy`` (llama-server)
    Reasoning as ``deepseek``, and content keeps the raw text with its tags (prefixed with
    ``<think>`` + ``prompt_tail`` when the prompt opened it).
``none`` (llama-server)
    No split. Content is the raw text, prefixed with ``<think>`` + ``prompt_tail`` when the
    prompt opened thinking (seed: ``"<think>\\n creek ..."``).

Streaming gives the same strings when its fragments are concatenated, with two exceptions
inherent to deciding early (vLLM streams the same way): ``deepseek_r1`` output that starts
thinking (``started_in_prompt`` or a leading ``<think>``) but never closes it was streamed as
reasoning, while the finished split says content; ``deepseek_r1`` output that did not start
thinking but writes ``</think>`` later streams as content (the split makes the text before
it reasoning: pass ``started_in_prompt`` when the template opened thinking); and
``deepseek_r1``/``qwen3`` text before a ``<think>`` that is not at the start is kept in the
stream but dropped by the split.

:class:`ThinkingBudget` is a per-request constraint for the engine (``mask`` /
``accept_token`` / ``is_terminated``) that forces the end tag after N thinking tokens and then
hands over to an inner constraint (a grammar for the answer), like llama-server's
``--reasoning-budget`` and vLLM's ``thinking_token_budget``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvserve.engine.detokenizer import partial_suffix

__all__ = [
    "REASONING_PARSERS",
    "REASONING_STYLES",
    "VLLM_REASONING_PARSERS",
    "Constraint",
    "ReasoningStreamer",
    "ThinkingBudget",
    "prompt_thinking_tail",
    "reasoning_marker_texts",
    "reasoning_parser_error",
    "split_reasoning",
]

#: vLLM ``--reasoning-parser`` names kvserve implements (each a ``style`` below).
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "glm45", "granite", "kimi_k2", "minimax_m2",
                     "minimax_m2_append_think", "mistral", "openai_gptoss", "qwen3", "seed_oss", "step3")

#: Every ``--reasoning-parser`` name vLLM registers (vllm/reasoning/__init__.py, recent releases
#: together); those not in :data:`REASONING_PARSERS` are refused at start-up.
VLLM_REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "ernie45", "gemma4", "glm45", "granite", "holo2", "hunyuan_a13b", "kimi_k2",
    "minimax_m2", "minimax_m2_append_think", "mistral", "olmo3", "openai_gptoss", "qwen3", "seed_oss", "step3",
    "step3p5",
)

#: Accepted ``style`` values ("auto" is llama-server's default and means "deepseek").
REASONING_STYLES = (*REASONING_PARSERS, "deepseek", "deepseek-legacy", "none", "auto")

_WS = " \t\n\r"

#: (start markers, end markers) of the marker styles (vLLM's texts)
_MARKERS = {
    "glm45": (("<think>",), ("</think>",)),
    "granite": (("Here is my thought process:", "Here's my thought process:"),
                ("Here is my response:", "Here's my response:")),
    "mistral": (("[THINK]",), ("[/THINK]",)),
}

#: styles that are ``qwen3``'s split with other tags: (start, end)
_QWEN3_LIKE = {"minimax_m2": ("<think>", "</think>"), "step3": ("<think>", "</think>"),
               "seed_oss": ("<seed:think>", "</seed:think>")}


#: gpt-oss harmony markers (control tokens of its vocabulary)
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def reasoning_marker_texts(style: str | None) -> tuple[str, ...]:
    """Marker texts a reasoning style parses (``<think>``/``</think>``, ``[THINK]``/``[/THINK]``,
    the harmony markers...): the chat face asks the detokenizer to render those that are one
    control token of the vocabulary (llama-server's ``preserved_tokens``). ``granite``'s markers
    are plain text: none. ``None`` (no split) gives ``()``; ``none`` and ``deepseek-legacy``
    keep the tags in the content, so they are rendered too (llama-server's formats preserve
    them whatever the reasoning format)."""
    if style is None:
        return ()
    if style == "openai_gptoss":
        return _HARMONY_MARKERS
    if style in _MARKERS:
        start, end = _MARKERS[style]
        return () if style == "granite" else (*start, *end)
    if style in _QWEN3_LIKE:
        return _QWEN3_LIKE[style]
    return ("<think>", "</think>")


def reasoning_parser_error(name: str) -> str | None:
    """The start-up error for ``--reasoning-parser name``, or None when kvserve implements it
    (a vLLM name kvserve lacks and an unknown name both list the implemented ones)."""
    if name in REASONING_PARSERS:
        return None
    names = ", ".join(REASONING_PARSERS)
    if name in VLLM_REASONING_PARSERS:
        return (f"--reasoning-parser {name!r} is a vLLM parser that kvserve does not implement; "
                f"implemented: {names}")
    return f"invalid --reasoning-parser {name!r}: choose from {names}"


def _tags(style: str, start: str, end: str) -> tuple[str, str]:
    return _QWEN3_LIKE.get(style, (start, end))


def _style(style: str, thinking_enabled: bool = True) -> tuple[str, bool]:
    """(base style, thinking_enabled) for a style name; aliases resolved."""
    if style not in REASONING_STYLES:
        raise ValueError(f"unknown reasoning style {style!r}; valid: {', '.join(REASONING_STYLES)}")
    if style in _QWEN3_LIKE:
        return "qwen3", thinking_enabled
    if style == "auto":
        return "deepseek", thinking_enabled
    if style == "kimi_k2":  # vLLM registers DeepSeekR1ReasoningParser under this name
        return "deepseek_r1", thinking_enabled
    if style == "deepseek_v3":  # R1's split when thinking, else none (identity: all content)
        return ("deepseek_r1", True) if thinking_enabled else ("qwen3", False)
    return style, thinking_enabled


def prompt_thinking_tail(prompt: str, start: str = "<think>", end: str = "</think>") -> str | None:
    """The prompt's text after a final unclosed ``start`` tag, or None when thinking is not open.

    ``"...<｜Assistant｜><think>\\n"`` gives ``"\\n"``: pass ``started_in_prompt=True`` and that
    tail as ``prompt_tail``.
    """
    i = prompt.rfind(start)
    if i < 0 or prompt.find(end, i) >= 0:
        return None
    return prompt[i + len(start):]


def split_reasoning(text: str, *, start: str = "<think>", end: str = "</think>", started_in_prompt: bool = False,
                    style: str = "deepseek_r1", prompt_tail: str = "",
                    thinking_enabled: bool = True) -> tuple[str | None, str]:
    """Split a finished output into (reasoning or None, content); see the module docstring.

    Args:
        text: the generated text only (not the prompt).
        started_in_prompt: the prompt ended inside an open ``start`` tag.
        prompt_tail: the prompt's text after that tag (llama-server styles use it).
        thinking_enabled: ``qwen3`` only (``enable_thinking``).

    Raises:
        ValueError: unknown style.
    """
    start, end = _tags(style, start, end)
    if style == "minimax_m2_append_think":
        return None, "<think>" + text
    if style == "glm45" and started_in_prompt:
        style = "deepseek_r1"  # the template opened <think>: only </think> is in the output
    style, thinking_enabled = _style(style, thinking_enabled)
    if style in _MARKERS or style == "openai_gptoss":
        return _split_by_streamer(text, style)
    if style == "none":
        return None, (start + prompt_tail if started_in_prompt else "") + text
    if style == "deepseek_r1":
        e = text.find(end)
        if e < 0:
            return None, text  # no end tag: no reasoning, whatever the prompt opened (vLLM)
        head = text[:e]
        s = head.find(start)
        reasoning = head[s + len(start):] if s >= 0 else head
        return reasoning.strip(), text[e + len(end):].strip()
    if style == "qwen3":
        if not thinking_enabled:
            return None, text
        _, found, after = text.partition(start)
        body = after if found else text
        reasoning, found, content = body.partition(end)
        return reasoning.strip(), content.strip() if found else ""
    # llama-server: deepseek / deepseek-legacy
    if started_in_prompt:
        body = prompt_tail + text
    elif text.startswith(start):
        body = text[len(start):]
    else:
        return None, text
    reasoning, found, after = body.partition(end)
    if style == "deepseek-legacy":
        return reasoning, (start + prompt_tail if started_in_prompt else "") + text
    return reasoning, after.lstrip(_WS) if found else ""


class _Field:
    """Streams one output field, optionally dropping leading and trailing whitespace."""

    __slots__ = ("held", "lstrip", "rstrip", "started")

    def __init__(self, lstrip: bool, rstrip: bool) -> None:
        self.lstrip, self.rstrip = lstrip, rstrip
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if self.lstrip and not self.started:
            text = text.lstrip(_WS)
            if not text:
                return ""
        self.started = True
        if not self.rstrip:
            return text
        text = self.held + text
        body = text.rstrip(_WS)
        self.held = text[len(body):]
        return body

    def end(self) -> str:
        """The field is over: trailing whitespace is dropped, or released when kept."""
        held, self.held = self.held, ""
        return "" if self.rstrip else held


class ReasoningStreamer:
    """Streaming split of one response; same arguments as :func:`split_reasoning`.

    ``feed(delta)`` / ``finish()`` return fragments ``{"reasoning": str}`` and
    ``{"content": str}`` in output order (face maps them to ``reasoning``/``reasoning_content``
    and ``content``). A possible partial tag is held back until it is decided. Not thread-safe.

    Attributes:
        reasoning_tokens: how many fed deltas were thinking (a delta counts when thinking was
            open when it began, the one holding the end tag included; fed one token's text
            per call this is ``completion_tokens_details.reasoning_tokens``). 0 for ``none``.
    """

    def __init__(self, *, style: str = "deepseek_r1", start: str = "<think>", end: str = "</think>",
                 started_in_prompt: bool = False, prompt_tail: str = "", thinking_enabled: bool = True) -> None:
        start, end = _tags(style, start, end)
        self._append_think = style == "minimax_m2_append_think"
        self._think_sent = False
        if self._append_think:
            style = "none"
        if style == "glm45" and started_in_prompt:
            style = "deepseek_r1"  # the template opened <think>: only </think> is in the output
        self.style, thinking_enabled = _style(style, thinking_enabled)
        self.start, self.end = start, end
        self.reasoning_tokens = 0
        self._impl: _MarkerStreamer | _HarmonyStreamer | None = None
        if self.style in _MARKERS:
            self._impl = _MarkerStreamer(*_MARKERS[self.style], unclosed_is_reasoning=self.style == "mistral")
        elif self.style == "openai_gptoss":
            self._impl = _HarmonyStreamer()
        self._pending_count = 0
        self._buf = ""
        self._held_from = 0
        self._prefix_done = False
        self._started_in_prompt = started_in_prompt and not self._append_think
        self._prompt_tail = prompt_tail
        vllm = self.style in ("deepseek_r1", "qwen3")
        self._reasoning = _Field(lstrip=vllm, rstrip=vllm)
        self._after = _Field(lstrip=True, rstrip=vllm)
        if self.style == "none" or self.style == "qwen3" and not thinking_enabled:
            self._phase = "content"
        elif started_in_prompt and self.style not in ("deepseek_r1", "qwen3"):
            self._phase = "reasoning"
        else:
            self._phase = "undecided"  # waiting to see whether the output opens with the tag

    @property
    def in_reasoning(self) -> bool:
        """Thinking is (or may still be) open: no answer text has been produced yet."""
        if self._impl is not None:
            return self._impl.in_reasoning
        return self._phase in ("undecided", "held", "reasoning")

    def feed(self, delta: str) -> list[dict]:
        if not delta:
            return []
        if self._impl is not None:
            out = self._impl.feed(delta)
            self.reasoning_tokens = self._impl.reasoning_tokens
            return _merge(out)
        if self.style != "none":
            if self._phase == "reasoning":
                self.reasoning_tokens += 1
            elif self._phase in ("undecided", "held"):
                self._pending_count += 1
        return self._emit(self._scan(delta, final=False), delta)

    def finish(self) -> list[dict]:
        if self._impl is not None:
            return _merge(self._impl.finish())
        parts = self._scan("", final=True)
        out = self._emit(parts, "", force_prefix=True)
        tail = self._reasoning.end()
        if tail:
            out.append({"reasoning": tail})
        tail = self._after.end()
        if tail:
            out.append({"content": tail})
        return _merge(out)

    # -- scanning: ("r" reasoning | "a" content after the end tag | "c" plain content, text) --

    def _scan(self, delta: str, final: bool) -> list[tuple[str, str]]:
        parts: list[tuple[str, str]] = []
        buf, self._buf = self._buf, ""
        buf += delta  # a local with one reference: CPython grows it in place (no copy per delta)
        self._buf = buf
        del buf
        if self._phase == "undecided":
            self._decide(final)
            if self._phase == "undecided":
                return parts
        if self._phase == "held":
            # the held text was searched up to _held_from already: a stream stays linear
            i = self._buf.find(self.end, self._held_from)
            if i < 0 and not final:
                self._held_from = max(0, len(self._buf) - len(self.end) + 1)
                return parts
            if i < 0:
                self._phase = "content"
            else:
                head = self._buf[:i].lstrip(_WS)
                if head.startswith(self.start):
                    self._buf = head[len(self.start):] + self._buf[i:]
                self._phase = "reasoning"
                self.reasoning_tokens += self._pending_count
            self._pending_count = 0
        if self._phase == "reasoning":
            i = self._buf.find(self.end)
            if i >= 0:
                parts.append(("r", self._buf[:i]))
                self._buf, self._phase = self._buf[i + len(self.end):], "after"
            else:
                k = 0 if final else partial_suffix(self._buf, self.end)
                parts.append(("r", self._buf[:len(self._buf) - k]))
                self._buf = self._buf[len(self._buf) - k:]
                return parts
        parts.append(("a" if self._phase == "after" else "c", self._buf))
        self._buf = ""
        return parts

    def _decide(self, final: bool) -> None:
        if self.style == "deepseek_r1":
            # Only an end tag makes text reasoning (002 Example 12; the prompt is not consulted):
            # hold the text until "</think>" shows up (reasoning) or the output ends (content).
            self._phase = "held"
            return
        vllm = self.style in ("deepseek_r1", "qwen3")
        s = self._buf.lstrip(_WS) if vllm else self._buf
        if s.startswith(self.start):
            self._buf = s[len(self.start):]
            self._phase = "reasoning"
        elif self.start.startswith(s) and not final:
            return
        elif self.style == "qwen3":
            self._phase = "reasoning"
        else:
            self._phase = "content"
        if self._phase == "reasoning":
            self.reasoning_tokens += self._pending_count
        self._pending_count = 0

    def _emit(self, parts: list[tuple[str, str]], raw: str, force_prefix: bool = False) -> list[dict]:
        out: list[dict] = []
        if not self._prefix_done and (raw or parts or force_prefix):
            self._prefix_done = True
            if self._started_in_prompt:
                if self.style in ("none", "deepseek-legacy"):
                    out.append({"content": self.start + self._prompt_tail})
                if self.style in ("deepseek", "deepseek-legacy") and self._prompt_tail:
                    out.append({"reasoning": self._prompt_tail})
        if self.style == "none":
            if raw:
                if self._append_think and not self._think_sent:
                    self._think_sent = True
                    raw = "<think>" + raw
                out.append({"content": raw})
            return _merge(out)
        for kind, text in parts:
            if kind == "r":
                text = self._reasoning.push(text)
                if text:
                    out.append({"reasoning": text})
            elif self.style == "deepseek-legacy":
                continue
            elif kind == "a":
                text = self._after.push(text)
                if text:
                    out.append({"content": text})
            elif text:
                out.append({"content": text})
        if self.style == "deepseek-legacy" and raw:
            out.append({"content": raw})
        return _merge(out)


class _MarkerStreamer:
    """``glm45`` / ``granite``: thinking only when the output opens with a start marker (after
    whitespace) and until an end marker; both parts stripped. vLLM's non-streaming split needs
    both markers (else all is content): a start marker never closed streams as reasoning but
    splits as content."""

    def __init__(self, starts: tuple[str, ...], ends: tuple[str, ...], unclosed_is_reasoning: bool = False) -> None:
        self.starts, self.ends = starts, ends
        self.unclosed_is_reasoning = unclosed_is_reasoning
        self.reasoning_tokens = 0
        self._phase = "undecided"  # undecided | reasoning | after | content
        self._buf = ""
        self._reasoning = _Field(lstrip=True, rstrip=True)
        self._after = _Field(lstrip=True, rstrip=True)
        self._sent_reasoning = False

    @property
    def in_reasoning(self) -> bool:
        return self._phase in ("undecided", "reasoning")

    def feed(self, delta: str) -> list[dict]:
        was = self._phase
        out = self._scan(delta, final=False)
        if self._phase == "reasoning" or (was == "reasoning" and self._phase == "after"):
            self.reasoning_tokens += 1
        return out

    def finish(self) -> list[dict]:
        out = self._scan("", final=True)
        tail = self._reasoning.end()
        if tail:
            out.append({"reasoning": tail})
        tail = self._after.end()
        if tail:
            out.append({"content": tail})
        return out

    def _scan(self, delta: str, final: bool) -> list[dict]:
        self._buf += delta
        out: list[dict] = []
        if self._phase == "undecided":
            s = self._buf.lstrip(_WS)
            m = next((m for m in self.starts if s.startswith(m)), None)
            if m is not None:
                self._buf, self._phase = s[len(m):], "reasoning"
            elif s and not final and any(x.startswith(s) for x in self.starts) or not s and not final:
                return out
            else:
                self._phase = "content"
        if self._phase == "reasoning":
            best, blen = -1, 0
            for m in self.ends:
                i = self._buf.find(m)
                if i >= 0 and (best < 0 or i < best):
                    best, blen = i, len(m)
            if best < 0:
                k = 0 if final else max(partial_suffix(self._buf, m) for m in self.ends)
                piece = self._reasoning.push(self._buf[:len(self._buf) - k])
                self._buf = self._buf[len(self._buf) - k:]
                if piece:
                    out.append({"reasoning": piece})
                return out
            piece = self._reasoning.push(self._buf[:best])
            if piece:
                out.append({"reasoning": piece})
            tail = self._reasoning.end()
            if tail:
                out.append({"reasoning": tail})
            self._buf, self._phase = self._buf[best + blen:], "after"
        if self._phase == "after":
            piece = self._after.push(self._buf)
            self._buf = ""
            if piece:
                out.append({"content": piece})
            return out
        if self._buf:
            out.append({"content": self._buf})
            self._buf = ""
        return out


class _HarmonyStreamer:
    """``openai_gptoss``: gpt-oss harmony channels (:mod:`kvserve.chat.harmony`). ``analysis``
    messages (and those to a built-in tool such as ``browser``) are reasoning, joined by
    ``"\n"`` as vLLM joins them; ``final`` and recipient-less ``commentary`` (preambles) are
    content; a message to ``functions.NAME`` is passed on whole as its harmony text (the
    ``openai`` tool parser makes the call of it). Output without harmony markers is content."""

    def __init__(self) -> None:
        from kvserve.chat.harmony import HarmonyParser

        self._p = HarmonyParser()
        self.reasoning_tokens = 0
        self.saw_reasoning = False
        self._n_reasoning_msgs = 0

    @property
    def in_reasoning(self) -> bool:
        m = self._p._msg
        return m is None and not self._p.messages or m is not None and self._is_reasoning(m)

    @staticmethod
    def _is_reasoning(m) -> bool:
        if m.recipient:
            return not m.recipient.startswith("functions.")
        return m.channel not in ("final", "commentary")

    def feed(self, delta: str) -> list[dict]:
        out = self._events(self._p.feed(delta))
        if any("reasoning" in f for f in out):
            self.reasoning_tokens += 1
        return out

    def finish(self) -> list[dict]:
        return self._events(self._p.finish())

    def _events(self, events) -> list[dict]:
        from kvserve.chat.harmony import encode_call_message

        out: list[dict] = []
        for ev in events:
            m = ev.message
            if ev.kind == "plain":
                out.append({"content": ev.text})
            elif ev.kind == "begin" and self._is_reasoning(m):
                self._n_reasoning_msgs += 1
                self.saw_reasoning = True
            elif ev.kind == "text" and self._is_reasoning(m):
                if self._n_reasoning_msgs > 1 and m.content == ev.text:  # first piece of a later message
                    out.append({"reasoning": "\n"})
                out.append({"reasoning": ev.text})
            elif ev.kind == "text" and not m.recipient:
                out.append({"content": ev.text})
            elif ev.kind == "end" and m.recipient and m.recipient.startswith("functions."):
                out.append({"content": encode_call_message(m)})
        return out


def _split_by_streamer(text: str, style: str) -> tuple[str | None, str]:
    """The finished split of the streamed styles: the streamer's fragments joined (so stream
    and split agree), reasoning None when there was no thinking (vLLM: both markers needed)."""
    if style == "openai_gptoss":
        h = _HarmonyStreamer()
        frags = h.feed(text) + h.finish()
        reasoning = "".join(f.get("reasoning", "") for f in frags)
        return (reasoning if h.saw_reasoning else None), "".join(f.get("content", "") for f in frags)
    starts, ends = _MARKERS[style]
    s = text.lstrip(_WS)
    m = next((m for m in starts if s.startswith(m)), None)
    unclosed_ok = style == "mistral"
    if m is None or not (unclosed_ok or any(e in s[len(m):] for e in ends)):
        return None, text
    ms = _MarkerStreamer(starts, ends, unclosed_is_reasoning=unclosed_ok)
    frags = ms.feed(text) + ms.finish()
    return ("".join(f.get("reasoning", "") for f in frags),
            "".join(f.get("content", "") for f in frags))


def _merge(frags: list[dict]) -> list[dict]:
    out: list[dict] = []
    for f in frags:
        (k, v), = f.items()
        if out and k in out[-1]:
            out[-1][k] += v
        else:
            out.append({k: v})
    return out


class Constraint(Protocol):
    """The engine's per-request constraint protocol (grammar matchers implement it)."""

    def mask(self) -> torch.Tensor | None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class ThinkingBudget:
    """Caps thinking at ``budget`` tokens, then gates to ``inner`` for the answer.

    Phases: ``before`` (output may open thinking with ``start_tag_ids``), ``thinking`` (no
    mask; tokens counted), ``forcing`` (after ``budget`` thinking tokens the mask allows only
    the next token of ``end_tag_token_ids``, one by one), ``answer`` (everything delegates to
    ``inner``; ``mask()`` is None when there is none). The model closing thinking itself (the
    end tag's ids in a row, or ``end_text`` in the decoded thinking text when ``token_text`` is
    given, for tags split differently across tokens) ends thinking without forcing.

    Args:
        budget: thinking tokens allowed; 0 forces the end tag at once, -1 means no limit
            (only the gating to ``inner``).
        end_tag_token_ids: tokens to force, e.g. tokenized ``"\\n</think>"``.
        n_vocab: mask length (the logits width, which may exceed the tokenizer's size).
        started_in_prompt: the prompt ended inside an open thinking tag.
        start_tag_ids: the opening tag's ids; when not started in the prompt, thinking begins
            only if the output starts with them (with ``inner`` set, the first token may be
            ``start_tag_ids[0]`` besides what ``inner`` allows, and the rest is then forced).
            Empty and not started: no thinking, straight to ``answer``.
        inner: the answer's constraint (e.g. a JSON-schema grammar matcher) or None.
        token_text: token id -> its decoded text, for text detection of the end tag.
        end_text: the end tag's text for that detection.
        eog_token_ids: end-of-generation ids, banned while thinking when ``inner`` is set (the
            answer it constrains must still come).

    Masks are bool [n_vocab] CPU tensors (True = allowed), shared between calls: read only.
    """

    def __init__(self, budget: int, end_tag_token_ids: Sequence[int], n_vocab: int, *,
                 started_in_prompt: bool, start_tag_ids: Sequence[int] = (), inner: Constraint | None = None,
                 token_text: Callable[[int], str] | None = None, end_text: str = "</think>",
                 eog_token_ids: Sequence[int] = ()) -> None:
        if budget < -1:
            raise ValueError(f"thinking budget must be >= -1, got {budget}")
        if not end_tag_token_ids:
            raise ValueError("end_tag_token_ids must not be empty")
        self.budget = budget
        self.end_ids = list(end_tag_token_ids)
        self.start_ids = list(start_tag_ids)
        self.n_vocab = n_vocab
        self.inner = inner
        self.token_text = token_text
        self.end_text = end_text
        self.thinking_tokens = 0  # free thinking tokens (forced ones not counted)
        self.forced = False  # the end tag was forced
        self._start_pos = 0
        self._force_pos = 0
        self._recent: deque[int] = deque(maxlen=len(self.end_ids))
        self._text = ""
        self._onehots: dict[int, torch.Tensor] = {}
        self._no_eog: torch.Tensor | None = None
        if inner is not None and eog_token_ids:
            # an answer is owed to ``inner`` (a schema, a forced tool call): thinking may not end
            # the output; max_tokens or the budget still bound it
            self._no_eog = torch.ones(n_vocab, dtype=torch.bool)
            self._no_eog[[t for t in eog_token_ids if 0 <= t < n_vocab]] = False
        if started_in_prompt:
            self.phase = "thinking"
            self._check_budget()
        else:
            self.phase = "before" if self.start_ids else "answer"

    # -- constraint protocol --

    def mask(self) -> torch.Tensor | None:
        if self.phase == "thinking":
            return self._no_eog
        if self.phase == "forcing":
            return self._onehot(self.end_ids[self._force_pos])
        if self.phase == "before":
            if self.inner is None:
                return None
            if self._start_pos > 0:
                return self._onehot(self.start_ids[self._start_pos])
            m = self.inner.mask()
            if m is None:
                return None
            m = m.clone()
            m[self.start_ids[0]] = True
            return m
        return self.inner.mask() if self.inner is not None else None

    def accept_token(self, token_id: int) -> bool:
        if self.phase == "thinking":
            self.thinking_tokens += 1
            if self._closed_by(token_id):
                self.phase = "answer"
            else:
                self._check_budget()
            return True
        if self.phase == "forcing":
            if token_id != self.end_ids[self._force_pos]:
                return False
            self._force_pos += 1
            if self._force_pos == len(self.end_ids):
                self.phase = "answer"
            return True
        if self.phase == "before":
            if token_id == self.start_ids[self._start_pos]:
                self._start_pos += 1
                if self._start_pos == len(self.start_ids):
                    self.phase = "thinking"
                    self._check_budget()
                return True
            if self._start_pos > 0:
                if self.inner is not None:
                    return False  # the rest of the start tag is forced
                self.phase = "answer"  # the model wrote something else: no thinking
                return True
            self.phase = "answer"
        return self.inner.accept_token(token_id) if self.inner is not None else True

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner is not None and self.inner.is_terminated()

    # -- helpers --

    @property
    def thinking(self) -> bool:
        """Thinking is open (counting or being forced shut)."""
        return self.phase in ("thinking", "forcing")

    def _check_budget(self) -> None:
        if self.budget >= 0 and self.thinking_tokens >= self.budget:
            self.phase, self.forced, self._force_pos = "forcing", True, 0

    def _closed_by(self, token_id: int) -> bool:
        self._recent.append(token_id)
        if list(self._recent) == self.end_ids:
            return True
        if self.token_text is not None and self.end_text:
            self._text = (self._text + self.token_text(token_id))[-(len(self.end_text) + 64):]
            return self.end_text in self._text
        return False

    def _onehot(self, token_id: int) -> torch.Tensor:
        m = self._onehots.get(token_id)
        if m is None:
            m = torch.zeros(self.n_vocab, dtype=torch.bool)
            m[token_id] = True
            self._onehots[token_id] = m
        return m
