"""What the server guarantees for a constrained output, checked without assuming what the model
writes (the same test must hold on AVX2, AVX512 and AMX machines, whose numerics differ).

A grammar that allows texts of any length (a JSON string or object of any size, a run of digits)
may be cut at the token limit: a 135M model does so on some CPUs and not on others. The server
guarantees that the text is a prefix its grammar accepts, that a cut output used every token it was
allowed (finish ``length``), and that an output that ended by itself is complete and valid.
"""

from __future__ import annotations

from collections.abc import Callable

_BACKENDS: dict[int, object] = {}


def _backend(tokenizer):
    from kvserve.structured.backend import GrammarBackend

    b = _BACKENDS.get(id(tokenizer))
    if b is None:
        b = _BACKENDS[id(tokenizer)] = GrammarBackend(tokenizer, len(tokenizer))
    return b


def accepts_prefix(tokenizer, body: dict, face: str, text: str) -> bool:
    """True when ``text`` is a prefix of some text the request's constraint allows: the constraint
    ``body`` asks for (read as the ``face`` reads it), compiled as the server compiles it."""
    import xgrammar as xgr

    from kvserve.structured.spec import constraint_from_body

    spec = constraint_from_body(body, face)
    matcher = xgr.GrammarMatcher(_backend(tokenizer).compile(spec).compiled)
    return not text or bool(matcher.accept_string(text))


def check_constrained(tokenizer, body: dict, face: str, text: str, finish: str, n_tokens: int,
                      max_tokens: int, valid: Callable[[str], object]) -> None:
    """Assert the guarantee for one constrained output.

    Args:
        tokenizer: the served model's Tokenizer.
        body: the request fields that carry the constraint (``response_format``, ``format``...).
        face: ``"openai"``, ``"llama"`` or ``"ollama"``, as for ``constraint_from_body``.
        text: the output text; finish: its finish reason in the face's words (``stop``/``eos``
            ended by the model, ``length``/``limit`` cut at the limit).
        n_tokens: the completion tokens the server counted; max_tokens: the request's limit.
        valid: true for a valid complete text (it may raise instead: json.loads, jsonschema).
    """
    assert accepts_prefix(tokenizer, body, face, text), (finish, text)
    if finish in ("length", "limit"):
        assert n_tokens == max_tokens, (finish, n_tokens, text)
        return
    assert finish in ("stop", "eos"), (finish, text)
    assert 0 < n_tokens <= max_tokens, (n_tokens, text)
    assert valid(text), text
