"""Caps on the lists and texts one request may send (issue 31), shared by every face.

Each list a client sends is capped in count (and its texts in bytes), so that one request cannot keep a
core busy for minutes or grow the server by gigabytes before any other check applies (the attack run
sent 10**6 rerank documents, 10**5 embedding inputs, 10**6 ``samplers``, a 30 MB /tokenize text).
A request over a cap gets 400 in its dialect's envelope naming the field, the cap and, where users
may need more, the flag that raises it:

=============================================  ===========  ==============================
list (routes)                                  cap          raised by
=============================================  ===========  ==============================
embedding inputs, rerank documents, score      2048 items   ``--max-batch-inputs``
pairs, completion prompts (/completion,
/v1/completions, /api/embed ``input``)
text of one embedding / rerank / score /       2 MiB        ``--max-input-bytes``
/tokenize request (all its texts together,
UTF-8 bytes)
/detokenize ``tokens``                         2 Mi ids     ``--max-input-bytes`` (one id
                                                            per byte, as /tokenize makes)
``samplers``                                   64           (there are 10 samplers)
``stop`` strings (llama, OpenAI, Ollama)       64 strings,  (Anthropic's face: the same)
                                               1000 chars
``tools``                                      512          (OpenAI allows 128)
``messages``                                   100000       (Anthropic's own limit)
content parts of one message                   10000        (Anthropic's blocks: the same)
``logit_bias``                                 vocabulary   (kvserve.faces.params)
``n`` x prompts                                2048         (kvserve.faces.openai)
=============================================  ===========  ==============================

Generation routes also refuse a prompt that cannot fit the context before tokenizing it
(:meth:`kvserve.loaders.tokenizer.Tokenizer.check_fits`); the byte cap is for the routes that
tokenize without that bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvserve.chat.prompt import MAX_CONTENT_PARTS, MAX_MESSAGES
from kvserve.faces.api_error import ApiError

__all__ = ["MAX_BATCH_INPUTS", "MAX_CONTENT_PARTS", "MAX_INPUT_BYTES", "MAX_MESSAGES", "MAX_SAMPLERS", "MAX_STOP",
           "MAX_STOP_CHARS", "MAX_TOOLS", "batch_cap", "check_count", "check_input_bytes", "input_bytes_cap"]

MAX_BATCH_INPUTS = 2048  # default of --max-batch-inputs (OpenAI's embeddings limit)
MAX_INPUT_BYTES = 2 << 20  # default of --max-input-bytes
MAX_SAMPLERS = 64
MAX_STOP = 64
MAX_STOP_CHARS = 1000
MAX_TOOLS = 512


def batch_cap(args: Any) -> int:
    """``--max-batch-inputs`` of the server's args (the default for args without it)."""
    return int(getattr(args, "max_batch_inputs", MAX_BATCH_INPUTS) or MAX_BATCH_INPUTS)


def input_bytes_cap(args: Any) -> int:
    """``--max-input-bytes`` of the server's args (the default for args without it)."""
    return int(getattr(args, "max_input_bytes", MAX_INPUT_BYTES) or MAX_INPUT_BYTES)


def check_count(field: str, n: int, cap: int, what: str = "items", flag: str | None = None) -> None:
    """Raise ApiError 400 ``Field '<field>': at most <cap> <what>, got <n>`` (+ the flag) when ``n > cap``."""
    if n > cap:
        hint = f" ({flag} raises the cap)" if flag else ""
        raise ApiError(400, f"Field '{field}': at most {cap} {what} per request, got {n}{hint}")


def check_input_bytes(field: str, texts: Iterable[Any], cap: int) -> None:
    """Raise ApiError 400 when the strings among ``texts`` have more than ``cap`` UTF-8 bytes together
    (token-id lists count nothing). O(characters), no copy of a text that is clearly under or over."""
    total = 0
    for t in texts:
        if not isinstance(t, str):
            continue
        if len(t) > cap - total:  # characters are a lower bound of the bytes: over already
            total = cap + 1
        else:
            total += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))
        if total > cap:
            raise ApiError(400, f"Field '{field}': the text is larger than {cap} bytes "
                                "(--max-input-bytes raises the cap)")
