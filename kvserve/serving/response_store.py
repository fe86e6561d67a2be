"""The in-memory store of OpenAI Responses API responses (``store: true``), for
``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``.

Each entry holds a response object (the JSON-able dict the face wrote), the input items of its
request (for ``GET /v1/responses/{id}/input_items``) and the conversation that a follow-up
request continues: the chat messages of every earlier turn, this turn's
input and its output, without ``instructions`` (OpenAI does not carry them over to the next
response). An entry holds its whole history rather than a link to its parent, so evicting an
old response never breaks a newer one that continued it.

Bounded by count and by bytes (the size of the entry's JSON text, input items and history
included; a history
shared with the parent entry is counted again, so the bound is never below the memory held).
The least recently used entries go first; reading an entry (``get``) makes it the most recent.
An entry larger than the whole byte budget is not stored (:meth:`ResponseStore.put` returns
False). Nothing here knows HTTP: a missing id is ``None`` / ``False``, the face answers 404.

Thread-safe: one lock guards the table (the face reads it on the event loop and may build
plans in worker threads).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_RESPONSES", "ResponseStore", "StoredResponse"]

#: at most this many responses are kept (then the least recently used is dropped)
DEFAULT_MAX_RESPONSES = 4096
#: at most this many bytes of JSON text are kept, histories included (128 MiB)
DEFAULT_MAX_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as written to the client (JSON-able dict); do not mutate.
        history: the chat messages (OpenAI chat format) a request with this response as
            ``previous_response_id`` starts from; do not mutate.
        nbytes: the bytes this entry counts against the store's budget.
        input_items: the request's input items as the Responses API lists them; do not mutate.
    """

    response: dict
    history: tuple[dict, ...]
    nbytes: int
    input_items: tuple[dict, ...] = ()


def entry_bytes(response: dict, history: tuple[dict, ...] | list[dict],
                input_items: tuple[dict, ...] | list[dict] = ()) -> int:
    """The bytes an entry counts: the UTF-8 length of its compact JSON text (response, history,
    then input items when there are any)."""
    parts = [response, list(history)] + ([list(input_items)] if input_items else [])
    dump = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return len(dump.encode("utf-8", errors="surrogatepass"))


class ResponseStore:
    """Responses by id, bounded by count and bytes, least recently used evicted first.

    Args:
        max_responses: most entries kept (>= 1).
        max_bytes: most bytes kept (>= 1), as counted by :func:`entry_bytes`.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("ResponseStore limits must be >= 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes held now (sum of the entries' ``nbytes``)."""
        with self._lock:
            return self._bytes

    def put(self, response_id: str, response: dict, history: list[dict] | tuple[dict, ...],
            input_items: list[dict] | tuple[dict, ...] = ()) -> bool:
        """Store (or replace) ``response_id``, evicting least recently used entries to make room.

        Returns:
            True when stored; False when the entry alone exceeds ``max_bytes`` (nothing is
            stored or evicted then, and an older entry under that id is removed).
        """
        hist, items = tuple(history), tuple(input_items)
        entry = StoredResponse(response, hist, entry_bytes(response, hist, items), items)
        with self._lock:
            self._drop(response_id)
            if entry.nbytes > self.max_bytes:
                return False
            while self._entries and (len(self._entries) >= self.max_responses
                                     or self._bytes + entry.nbytes > self.max_bytes):
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
            self._entries[response_id] = entry
            self._bytes += entry.nbytes
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None when absent or evicted."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        """Remove an entry; False when there was none."""
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True
