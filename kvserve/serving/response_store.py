"""The in-memory store of OpenAI Responses API responses (``store: true``), for
``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``.

Each entry holds a response object (the JSON-able dict the face wrote), the input items of its
request (for ``GET /v1/responses/{id}/input_items``) and the conversation that a follow-up
request continues: the chat messages of every earlier turn, this turn's
input and its output, without ``instructions`` (OpenAI does not carry them over to the next
response). An entry holds its whole history rather than a link to its parent, so evicting an
old response never breaks a newer one that continued it.

An entry is kept as three compact JSON texts (UTF-8 bytes, non-ASCII escaped: the response
text is what ``GET`` answers, byte for byte) and parsed again on read, so the bytes counted
against the budget ARE the memory held (a parsed Python object costs many times its JSON: an
``{}`` is 2 bytes of text but ~64 bytes of dict). Bounded by count and by those bytes; a history
shared with the parent entry is counted (and held) again. The least recently used entries go
first; reading an entry (``get``) makes it the most recent. An entry larger than the whole byte
budget is not stored (:meth:`ResponseStore.put` returns False).

Each entry has an owner (an opaque string: the face passes a hash of the API key that created
it, or ``""`` when the server has no keys); ``get`` and ``delete`` with another owner see
nothing, as if the id were not stored. Nothing here knows HTTP: a missing id is ``None`` /
``False``, the face answers 404.

Thread-safe: one lock guards the table (the face serializes and parses in worker threads).
``put`` serializes outside the lock; callers with large entries call it off the event loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_RESPONSES", "ResponseStore", "StoredResponse", "entry_bytes"]

#: at most this many responses are kept (then the least recently used is dropped)
DEFAULT_MAX_RESPONSES = 4096
#: at most this many bytes of JSON text are kept, histories included (128 MiB)
DEFAULT_MAX_BYTES = 128 * 1024 * 1024


def _dump(obj) -> bytes:
    """Compact JSON, non-ASCII escaped (as the faces write it), as bytes."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its three parts as compact JSON bytes, parsed on each read.

    Attributes:
        response_json: the response object as the client got it (compact JSON, ASCII).
        history_json: the chat messages (a JSON array, OpenAI chat format) a request with this
            response as ``previous_response_id`` starts from.
        input_items_json: the request's input items (a JSON array) as the Responses API lists them.
        owner: who may read or delete it (see :class:`ResponseStore`).
    """

    response_json: bytes
    history_json: bytes
    input_items_json: bytes = b"[]"
    owner: str = ""

    @property
    def nbytes(self) -> int:
        """The bytes this entry counts against the store's budget: its three JSON texts."""
        return len(self.response_json) + len(self.history_json) + len(self.input_items_json)

    @property
    def response(self) -> dict:
        """The response object (a new dict on each read)."""
        return json.loads(self.response_json)

    @property
    def history(self) -> tuple[dict, ...]:
        """The conversation's chat messages (new dicts on each read)."""
        return tuple(json.loads(self.history_json))

    @property
    def input_items(self) -> tuple[dict, ...]:
        """The request's input items (new dicts on each read)."""
        return tuple(json.loads(self.input_items_json))


def entry_bytes(response: dict, history: tuple[dict, ...] | list[dict],
                input_items: tuple[dict, ...] | list[dict] = ()) -> int:
    """The bytes an entry counts: the lengths of its three compact JSON texts (non-ASCII
    escaped), response, history and input items."""
    return len(_dump(response)) + len(_dump(list(history))) + len(_dump(list(input_items)))


class ResponseStore:
    """Responses by id, bounded by count and bytes, least recently used evicted first, each
    visible to its owner only.

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
            input_items: list[dict] | tuple[dict, ...] = (), owner: str = "") -> bool:
        """Store (or replace) ``response_id`` for ``owner``, evicting least recently used entries
        to make room. Serializes the entry (CPU work proportional to its size).

        Returns:
            True when stored; False when the entry alone exceeds ``max_bytes`` (nothing is
            stored or evicted then, and an older entry under that id is removed).

        Raises:
            ValueError: a value JSON cannot write (NaN, infinity) or nested too deep.
        """
        entry = StoredResponse(_dump(response), _dump(list(history)), _dump(list(input_items)), owner)
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

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """The entry (now the most recently used), or None when absent, evicted or another
        owner's."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Remove an entry; False when there was none (or it is another owner's)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True
