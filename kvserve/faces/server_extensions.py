"""What llama-server adds to every dialect it serves, in one place for the faces that write it:
the ``timings`` object and the ``prompt_progress`` events of a stream (``return_progress``), which
llama-server's own ``/completion`` (:mod:`kvserve.faces.llama_api`) and its OpenAI-compatible routes
(:mod:`kvserve.faces.openai`) both send. Neither face imports the other for them.

Wire rules: see :mod:`kvserve.faces.wire` (fields without a default always written; fields with a
default only when given).
"""

from __future__ import annotations

from typing import Any

from kvserve.engine.request import RequestOutput
from kvserve.engine.request import Timings as EngineTimings
from kvserve.faces.wire import WireModel

__all__ = ["ProgressEvents", "PromptProgress", "Timings"]


class Timings(WireModel):
    """llama.cpp's ``timings`` (ms, token counts; rates derived by
    :meth:`kvserve.engine.request.Timings.to_dict`, which :meth:`of` reads).

    ``predicted_per_token_ms`` divides by decode steps (tokens - 1, seed 000 Example 6).
    ``cache_miss`` is kvserve's: why fewer prompt tokens were reused than a cached candidate
    offered; present only when something was missed.
    """

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = None  # speculative decoding (llama-server): only when something was drafted
    draft_n_accepted: int | None = None
    cache_miss: dict[str, Any] | None = None

    @classmethod
    def of(cls, t) -> Timings:
        """The wire object of an engine :class:`kvserve.engine.request.Timings`."""
        return cls(**t.to_dict())


class PromptProgress(WireModel):
    """llama-server's ``prompt_progress`` (``return_progress`` in a stream): prompt tokens in
    all, reused from the cache, in the KV so far (cached ones included), and ms since prompt
    processing started."""

    total: int
    cache: int
    processed: int
    time_ms: int


class ProgressEvents:
    """llama-server's ``prompt_progress`` events of one sequence (``return_progress`` in a stream),
    from its engine outputs: before the first token, one at 0% (``processed`` = ``cache``,
    ``time_ms`` 0), one per prompt chunk the engine ran (the engine's token-less outputs with
    ``prompt_progress``), and one at 100% (``processed`` = ``total``) when the first token comes.
    Nothing after the first token. Each event comes with the timings at that point (what
    llama-server sends with ``timings_per_token``: the prompt tokens computed and their ms, no
    predicted tokens yet). Used by the llama-server face (``/completion``) and the OpenAI face."""

    def __init__(self) -> None:
        self.shown = False  # the 0% event was sent
        self.done = False  # the first token came

    def feed(self, out: RequestOutput) -> list[tuple[PromptProgress, EngineTimings]]:
        """The (progress, timings) pairs to send before ``out``'s own event (if any)."""
        if self.done:
            return []
        p = out.prompt_progress
        if p is not None:
            total, cache, processed, ms = p.total, p.cache, p.processed, p.time_ms
        else:
            self.done = True
            total, cache = out.num_prompt_tokens, out.num_cached_tokens
            processed, ms = total, int(out.timings.prompt_ms)
        t = out.timings
        events = []
        if not self.shown:
            self.shown = True
            events.append((PromptProgress(total=total, cache=cache, processed=cache, time_ms=0),
                           EngineTimings(cache_n=cache)))
        events.append((PromptProgress(total=total, cache=cache, processed=processed, time_ms=ms),
                       EngineTimings(cache_n=cache, prompt_n=processed - cache, prompt_ms=t.prompt_ms)))
        return events
