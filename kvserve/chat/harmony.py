"""OpenAI harmony messages (gpt-oss output), parsed incrementally from decoded text.

A gpt-oss assistant turn is a run of messages, each
``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>CONTENT`` ended by
``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the turn's last message). The
generation prompt ends with ``<|start|>assistant``, so the output starts at ``<|channel|>``.
Channels: ``analysis`` (thinking), ``commentary`` (tool calls, which carry a ``to=functions.NAME``
recipient, and preambles shown to the user), ``final`` (the answer). The recipient may also
stand before the channel (``<|start|>assistant to=functions.f<|channel|>commentary json``), and
the content type may be a bare word after the recipient (``json``) instead of ``<|constrain|>``.

:class:`HarmonyParser` is fed text deltas and reports :class:`HarmonyEvent` s. It works on text,
not token ids (vLLM parses ids with ``openai-harmony``): the harmony markers must be rendered in
the decoded text (they are control tokens of the gpt-oss vocabulary; see the module notes of
:mod:`kvserve.chat.tool_calls`). The stop tokens ``<|call|>`` / ``<|return|>`` usually end
generation and are then not in the text: a message open at the end of the text is reported
ended with ``terminator=""``.

Output that does not start with a harmony marker (after whitespace) is plain text: reported as
one ``"plain"`` event per delta (nothing held back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.engine.detokenizer import partial_suffix

__all__ = ["HarmonyEvent", "HarmonyMessage", "HarmonyParser", "encode_call_message"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END_MARKERS = ("<|end|>", "<|call|>", "<|return|>")
_CONTENT_STOPS = (*END_MARKERS, START)
_HEAD_MARKERS = (CHANNEL, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CONSTRAIN_RE = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_WS = " \t\n\r"


@dataclass(slots=True)
class HarmonyMessage:
    """One message. ``content`` grows while it streams; ``terminator`` is set when it ends
    (``"<|end|>"``, ``"<|call|>"``, ``"<|return|>"``, or ``""``: cut off / next message began)."""

    role: str
    channel: str
    recipient: str | None
    content_type: str | None
    content: str = ""
    terminator: str | None = None


@dataclass(slots=True)
class HarmonyEvent:
    """``kind``: ``"begin"`` (header parsed), ``"text"`` (``text`` appended to ``message``),
    ``"end"`` (message complete), ``"plain"`` (non-harmony text, in ``text``), ``"junk"``
    (text between messages that is not a header, in ``text``)."""

    kind: str
    message: HarmonyMessage | None = None
    text: str = ""


def parse_header(header: str) -> HarmonyMessage:
    """A message header (the text before ``<|message|>``) -> an empty :class:`HarmonyMessage`."""
    h = header.strip(_WS)
    h = h.removeprefix(START)
    recipient = None
    m = _RECIPIENT.search(h)
    if m:
        recipient = m.group(1)
    content_type = None
    m = _CONSTRAIN_RE.search(h)
    if m:
        content_type = m.group(1)
    role_part, _, rest = h.partition(CHANNEL)
    role = _RECIPIENT.sub("", role_part).strip(_WS) or "assistant"
    channel = ""
    if rest:
        words = _CONSTRAIN_RE.sub(" ", rest).split()
        if words:
            channel = words[0]
            if content_type is None:
                extra = [w for w in words[1:] if not w.startswith("to=")]
                if extra:
                    content_type = extra[-1]
    return HarmonyMessage(role=role, channel=channel, recipient=recipient, content_type=content_type)


def encode_call_message(msg: HarmonyMessage) -> str:
    """The canonical harmony text of a message with a recipient (a tool call), ended by
    ``<|call|>``: what the ``openai_gptoss`` reasoning split passes on for the ``openai`` tool
    parser."""
    ct = f" {CONSTRAIN}{msg.content_type}" if msg.content_type else ""
    return f"{CHANNEL}{msg.channel} to={msg.recipient}{ct}{MESSAGE}{msg.content}<|call|>"


class HarmonyParser:
    """Incremental harmony parser for one output (see the module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "first"  # first | header | content | plain
        self._msg: HarmonyMessage | None = None
        self.messages: list[HarmonyMessage] = []  # ended messages, in order

    def feed(self, text: str) -> list[HarmonyEvent]:
        """Events for one text delta."""
        if not text:
            return []
        if self._state == "plain":
            return [HarmonyEvent("plain", text=text)]
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[HarmonyEvent]:
        """Events at the end of the output: an open message ends with ``terminator=""``."""
        events = self._run(final=True)
        if self._state == "content" and self._msg is not None:
            events += self._end("")
        elif self._state in ("header", "first") and self._buf.strip(_WS):
            events.append(HarmonyEvent("junk" if self._state == "header" else "plain", text=self._buf))
        self._buf = ""
        return events

    def _run(self, final: bool) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        while True:
            if self._state == "first":
                s = self._buf.lstrip(_WS)
                if not s:
                    return events
                if any(s.startswith(m) for m in _HEAD_MARKERS):
                    self._state = "header"
                    continue
                if any(m.startswith(s) for m in _HEAD_MARKERS) and not final:
                    return events
                self._state = "plain"
                text, self._buf = self._buf, ""
                events.append(HarmonyEvent("plain", text=text))
                return events
            if self._state == "header":
                i = self._buf.find(MESSAGE)
                if i < 0:
                    return events
                header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
                j = max(header.rfind(START), header.find(CHANNEL) if START not in header else -1)
                if j > 0 and header[:j].strip(_WS):  # text before the header: not part of any message
                    events.append(HarmonyEvent("junk", text=header[:j]))
                    header = header[j:]
                self._msg = parse_header(header)
                self._state = "content"
                events.append(HarmonyEvent("begin", self._msg))
                continue
            if self._state == "content":
                assert self._msg is not None
                best, which = -1, ""
                for m in _CONTENT_STOPS:
                    k = self._buf.find(m)
                    if k >= 0 and (best < 0 or k < best):
                        best, which = k, m
                if best < 0:
                    hold = 0 if final else max(partial_suffix(self._buf, m) for m in _CONTENT_STOPS)
                    piece = self._buf[:len(self._buf) - hold]
                    self._buf = self._buf[len(piece):]
                    if piece:
                        self._msg.content += piece
                        events.append(HarmonyEvent("text", self._msg, piece))
                    return events
                piece = self._buf[:best]
                if piece:
                    self._msg.content += piece
                    events.append(HarmonyEvent("text", self._msg, piece))
                if which == START:
                    self._buf = self._buf[best:]
                    events += self._end("")
                else:
                    self._buf = self._buf[best + len(which):]
                    events += self._end(which)
                self._state = "header"
                continue
            return events  # plain: handled in feed

    def _end(self, terminator: str) -> list[HarmonyEvent]:
        msg, self._msg = self._msg, None
        assert msg is not None
        msg.terminator = terminator
        self.messages.append(msg)
        return [HarmonyEvent("end", msg)]
