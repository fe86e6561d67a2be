"""Incremental, UTF-8-safe detokenizer with stop-string hold-back.

One :class:`IncrementalDetokenizer` per generated sequence. The engine feeds it each
generated token id; it returns the text that is safe to send now:

* UTF-8 safety: a token's piece may end in the middle of a multi-byte character (byte-level
  BPE vocabularies split rare characters over several tokens). Those bytes are kept until the
  character is complete, then the whole character is emitted; U+FFFD never appears for a split
  character. Bytes that can never form a character (invalid UTF-8 from the model) become
  U+FFFD at once, as Python's and llama-server's JSON output do.
* Stop strings: any suffix of the pending text that is a prefix of a stop string is held back,
  so a partial stop string never leaks, also when it spans tokens. When a stop string
  matches, the text before it is emitted and the stop string and anything after it are not
  (llama-server ``stop`` / vLLM ``stop`` with ``include_stop_str_in_output=False``). When
  several stop strings match, the one starting earliest wins; on a tie, the first listed
  (llama-server ``find_stopping_strings``).
* Control tokens (``<|im_end|>``...) contribute no text, as in llama-server's output;
  user-defined tokens contribute their text. Two exceptions: ``include_control`` renders every
  control token (vLLM ``skip_special_tokens=False``, llama-server ``--special``), and
  ``preserved`` ids are rendered while the others stay hidden (llama-server's "preserved
  tokens": the chat format's markers, e.g. Kimi K2's ``<|tool_call_begin|>`` or gpt-oss's
  ``<|channel|>``, reach the tool-call / reasoning parser). A rendered control token goes
  through the stop-string check like any text.

End of generation: :meth:`flush` returns the held-back partial stop text. If generation ended
in the middle of a character, the incomplete trailing bytes are dropped (not emitted as
U+FFFD) — a documented difference from llama-server, which would send U+FFFD.
"""

from __future__ import annotations

import codecs
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "partial_suffix"]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (text to
    hold back while streaming, because ``marker`` may be completed by what comes next)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int, special: bool = True) -> bytes: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into UTF-8-safe text deltas, honouring stop strings.

    Args:
        tokenizer: anything with ``token_bytes(id, special) -> bytes``
            (:class:`kvserve.loaders.tokenizer.Tokenizer`).
        stop: stop strings (empty strings are ignored).
        include_control: render control tokens' text (default False: they add no text,
            as in llama-server's generated content).
        preserved: token ids rendered with their text even when ``include_control`` is False
            (llama-server ``preserved_tokens``); ids that are not control tokens are
            rendered anyway.

    Attributes:
        stop_string: the stop string that matched, or None.
        finished: True once a stop string matched or :meth:`flush` was called; later
            :meth:`add` calls return ``("", None)``.
    """

    __slots__ = ("_tok", "_stops", "_max_hold", "_special", "_preserved", "_decoder", "_held", "_parts",
                 "stop_string", "finished")

    def __init__(self, tokenizer: _TokenBytes, stop: tuple[str, ...] = (), include_control: bool = False,
                 preserved: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._special = include_control
        self._preserved = frozenset(preserved)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not emitted yet (a possible stop-string prefix)
        self._parts: list[str] = []
        self.stop_string: str | None = None
        self.finished = False

    @classmethod
    def for_params(cls, tokenizer: _TokenBytes, params) -> IncrementalDetokenizer:
        """The detokenizer of one request: ``params`` is its
        :class:`~kvserve.engine.request.SamplingParams` (``stop``, ``skip_special_tokens``,
        ``preserved_token_ids``)."""
        return cls(tokenizer, params.stop, include_control=not getattr(params, "skip_special_tokens", True),
                   preserved=getattr(params, "preserved_token_ids", frozenset()))

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def pending_text(self) -> str:
        """Text decoded but held back (a possible stop-string prefix); not yet emitted."""
        return self._held

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one generated token.

        Returns:
            (delta, stop): ``delta`` is new text safe to emit (may be ""); ``stop`` is the
            stop string that matched with this token, else None. After a match the
            detokenizer is finished and ignores further tokens.

        Raises:
            IndexError: token id outside the vocabulary.
        """
        if self.finished:
            return "", None
        piece = self._tok.token_bytes(token_id, self._special or token_id in self._preserved)
        if not piece:
            return "", None
        new = self._decoder.decode(piece)
        if not new:
            return "", None
        s = self._held + new
        if not self._stops:
            self._held = ""
            self._parts.append(s)
            return s, None
        # Full match: any match overlaps the new text (earlier text had none, and every
        # possible match start was held back), so searching held + new is enough.
        best_pos = -1
        best_stop: str | None = None
        for st in self._stops:
            pos = s.find(st)
            if pos >= 0 and (best_pos < 0 or pos < best_pos):
                best_pos, best_stop = pos, st
        if best_stop is not None:
            out = s[:best_pos]
            self._held = ""
            self.stop_string = best_stop
            self.finished = True
            if out:
                self._parts.append(out)
            return out, best_stop
        hold = self._hold_len(s)
        out = s[: len(s) - hold]
        self._held = s[len(s) - hold:]
        if out:
            self._parts.append(out)
        return out, None

    def _hold_len(self, s: str) -> int:
        """Length of the longest suffix of ``s`` that is a proper prefix of some stop string."""
        return max(partial_suffix(s, st) for st in self._stops)

    def flush(self) -> str:
        """End of generation: return the held-back text (a stop-string prefix that never
        completed). Incomplete UTF-8 bytes at the very end are dropped, never emitted as
        U+FFFD. Returns "" after a stop-string match. Idempotent."""
        if self.finished:
            return ""
        self.finished = True
        out = self._held
        self._held = ""
        self._decoder.reset()
        if out:
            self._parts.append(out)
        return out
