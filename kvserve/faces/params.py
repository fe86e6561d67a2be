"""Request JSON -> SamplingParams with llama-server's field names, and back.

Every face reads sampling fields through :func:`sampling_params_from_body`, so a
field means the same thing on ``/completion``, ``/v1/completions`` and
``/v1/chat/completions``. Wrong JSON types give 400 naming the field
(``Field 'temperature': type must be number, but is string``, llama-server's
wording without nlohmann's exception prefix); out-of-range values give 400:
a number beyond float range, a non-finite float (NaN, Infinity, 1e400) in any
float field, an integer outside int64, ``n_probs`` above ``--max-logprobs``
(vLLM's flag and wording, default 20), more than ``MAX_DRY_BREAKERS`` (256)
``dry_sequence_breakers``.

Lone surrogates: ``json.loads`` accepts ``"\\ud800"``, a string no UTF-8 encoder
(tokenizer, hash, log) can write. :func:`check_text` refuses any such string in a
body (400 naming its path, e.g. ``messages[0].content``); the getters below check
the strings they return too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvserve.engine.request import SEED_RANDOM, SamplingParams
from kvserve.errors import InvalidInputError
from kvserve.faces.api_error import ApiError
from kvserve.faces.limits import MAX_SAMPLERS, MAX_STOP, MAX_STOP_CHARS, check_count
from kvserve.jsonvalues import SURROGATE as _SURROGATE  # noqa: F401 - re-exported
from kvserve.jsonvalues import check_text, json_type

#: vLLM's ``--max-logprobs`` default: the most top candidates a request may ask for per token.
DEFAULT_MAX_LOGPROBS = 20
#: at most this many ``dry_sequence_breakers`` per request (llama-server has no limit; its
#: sampler truncates each breaker to 40 characters, as kvserve's does).
MAX_DRY_BREAKERS = 256
#: integers outside nlohmann::json's int64 are refused (llama-server would overflow them).
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
#: fields llama-server reads that kvserve accepts but does not implement: checked as finite numbers.
_UNUSED_NUMBER_FIELDS = ("dynatemp_range", "dynatemp_exponent", "mirostat_tau", "mirostat_eta")

# JSON field -> (SamplingParams attribute, kind)
_NUMBER_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "top_n_sigma": "top_n_sigma",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "repeat_penalty": "repeat_penalty",
    "repetition_penalty": "repeat_penalty",  # vLLM's name (its sampling extra), as generation_config.json's
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "speculative.p_min": "spec_p_min",  # llama-server's flat dotted key; range-checked by SamplingParams
}
_INT_FIELDS = {
    "top_k": "top_k",
    "repeat_last_n": "repeat_last_n",
    "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n",
    "min_tokens": "min_tokens",
    "n_probs": "n_probs",
    "n_cache_reuse": "n_cache_reuse",
    "speculative.n_max": "spec_n_max",  # llama-server's flat dotted keys
    "speculative.n_min": "spec_n_min",
}
_BOOL_FIELDS = {
    "ignore_eos": "ignore_eos",
    "post_sampling_probs": "post_sampling_probs",
    "cache_prompt": "cache_prompt",
}

# llama.cpp sampler names (common_sampler_types_from_names, with aliases) and chars
_SAMPLER_NAMES = {
    "penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma",
    "top_k": "top_k", "top-k": "top_k", "typ_p": "typ_p", "typ-p": "typ_p", "typical_p": "typ_p",
    "typical-p": "typ_p", "typ": "typ_p", "typical": "typ_p", "top_p": "top_p", "top-p": "top_p",
    "nucleus": "top_p", "min_p": "min_p", "min-p": "min_p", "xtc": "xtc", "temperature": "temperature",
    "temp": "temperature",
}
_SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                  "m": "min_p", "x": "xtc", "t": "temperature"}


def type_error(field: str, want: str, v: Any) -> ApiError:
    """400 ``Field 'X': type must be W, but is T``."""
    return ApiError(400, f"Field '{field}': type must be {want}, but is {json_type(v)}")


def get_number(body: dict, key: str, default: float | None = None) -> float | None:
    """``body[key]`` as a float (null/absent -> default); 400 on a non-number or an integer
    beyond float range (``float()`` would raise OverflowError). NaN and infinities pass:
    callers that need finite values check (SamplingParams does)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise type_error(key, "number", v)
    try:
        return float(v)
    except OverflowError:
        raise ApiError(400, f"Field '{key}': number out of range") from None


def get_int(body: dict, key: str, default: int | None = None) -> int | None:
    """``body[key]`` as an int (numbers are truncated, as nlohmann's get<int> does).

    Raises:
        ApiError: 400 on a non-number, a non-finite float, or a value outside int64.
    """
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise type_error(key, "number", v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ApiError(400, f"Field '{key}': must be a finite number")
        v = int(v)
    if not _INT_MIN <= v <= _INT_MAX:
        raise ApiError(400, f"Field '{key}': integer out of range (int64)")
    return v


def get_bool(body: dict, key: str, default: bool | None = None) -> bool | None:
    """``body[key]`` as a bool; 400 on a non-boolean."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise type_error(key, "boolean", v)
    return v


def get_str(body: dict, key: str, default: str | None = None) -> str | None:
    """``body[key]`` as a string; 400 on a non-string or one with a lone surrogate."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise type_error(key, "string", v)
    if _SURROGATE.search(v):
        check_text(v, key)  # raises, naming the field
    return v


def stop_strings(v: Any) -> tuple[str, ...]:
    """``stop``: a string or an array of strings, at most ``MAX_STOP`` of at most ``MAX_STOP_CHARS``
    characters each (400 naming ``stop``)."""
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        check_count("stop", len(v), MAX_STOP, "stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ApiError(400, f"Field 'stop': each stop string has at most {MAX_STOP_CHARS} characters")
        return tuple(v)
    raise type_error("stop", "string or array of strings", v)


def _samplers(v: Any) -> tuple[str, ...]:
    if isinstance(v, (str, list)):
        check_count("samplers", len(v), MAX_SAMPLERS, "samplers")
    if isinstance(v, str):
        return tuple(_SAMPLER_CHARS[c] for c in v if c in _SAMPLER_CHARS)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(_SAMPLER_NAMES[s.lower()] for s in v if s.lower() in _SAMPLER_NAMES)
    raise type_error("samplers", "string or array of strings", v)


def _dry_breakers(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise type_error("dry_sequence_breakers", "array of strings", v)
    if len(v) > MAX_DRY_BREAKERS:
        raise ApiError(400, f"Field 'dry_sequence_breakers': at most {MAX_DRY_BREAKERS} sequence breakers "
                            f"are allowed, got {len(v)}")
    return tuple(v)


#: most logit_bias entries when the vocabulary size is not known
MAX_LOGIT_BIAS = 1 << 18


def _bias_value(field: str, b: Any) -> float:
    """A bias: a number (-inf bans, +inf forces; 1e400 reads as inf) or false (= -inf), never NaN."""
    if b is False:
        return float("-inf")
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise type_error(field, "number or false", b)
    try:
        b = float(b)
    except OverflowError:
        raise ApiError(400, f"Field '{field}': bias out of range") from None
    if math.isnan(b):
        raise ApiError(400, f"Field '{field}': bias must be a number or false, not NaN")
    return b


def _token_ids_for(key: Any, tokenizer) -> list[int]:
    """A logit_bias key: a token id (int, or a string of digits in the object form) or a text."""
    if isinstance(key, bool):
        raise type_error("logit_bias", "number or string", key)
    if isinstance(key, int):
        return [key]
    if isinstance(key, float):  # llama-server reads a JSON number as an int: 5.0 is token 5
        if not key.is_integer():
            raise ApiError(400, f"Field 'logit_bias': token id must be an integer, got {key!r}")
        return [int(key)]
    if isinstance(key, str):
        try:
            return [int(key)]
        except ValueError:
            return list(tokenizer.encode(key, add_special=False, parse_special=False)) if tokenizer else []
    raise type_error("logit_bias", "number or string", key)


def parse_logit_bias(v: Any, tokenizer) -> dict[int, float]:
    """llama.cpp's logit_bias forms: ``[[id|text, bias|false], ...]`` or ``{"id"|"text": bias|false}``.

    A text applies the bias to each of its tokens; ids outside the vocabulary are ignored.
    """
    n_vocab = getattr(tokenizer, "n_vocab", None)
    pairs: list[tuple[Any, Any]] = []
    if isinstance(v, dict):
        pairs = list(v.items())
    elif isinstance(v, list):
        for el in v:
            if not isinstance(el, list) or len(el) != 2:
                raise ApiError(400, "Field 'logit_bias': each element must be a [token, bias] pair")
            pairs.append((el[0], el[1]))
    else:
        raise type_error("logit_bias", "array or object", v)
    cap = n_vocab or MAX_LOGIT_BIAS
    if len(pairs) > cap:
        raise ApiError(400, f"Field 'logit_bias': at most {cap} entries (one per token of the vocabulary), "
                            f"got {len(pairs)}")
    out: dict[int, float] = {}
    for key, b in pairs:
        bias = _bias_value("logit_bias", b)
        for tid in _token_ids_for(key, tokenizer):
            if tid >= 0 and (n_vocab is None or tid < n_vocab):
                out[tid] = bias
    return out


def sampling_params_from_body(body: dict, defaults: SamplingParams, tokenizer, *,
                              max_tokens_keys: tuple[str, ...] = ("n_predict",),
                              max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingParams:
    """Build SamplingParams from a request body over the server ``defaults``: the fields
    :func:`sampling_fields` reads, applied by :func:`kvserve.serving.chat_plan.apply_sampling`.

    Raises:
        ApiError: 400 on a wrong type or an out-of-range value.
    """
    from kvserve.serving.chat_plan import apply_sampling

    kw = sampling_fields(body, tokenizer, max_tokens_keys=max_tokens_keys, max_logprobs=max_logprobs)
    try:
        return apply_sampling(defaults, kw)
    except InvalidInputError as e:
        raise ApiError(400, str(e)) from e.__cause__


def sampling_fields(body: dict, tokenizer, *, max_tokens_keys: tuple[str, ...] = ("n_predict",),
                    max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> dict[str, Any]:
    """The :class:`SamplingParams` fields a request body sets (llama-server's and OpenAI's names),
    checked for type and range; ``logit_bias`` as token id -> bias (not yet merged with the
    server's).

    The whole body is checked for lone surrogates first (:func:`check_text`), so a face
    that builds its sampling parameters before tokenizing never hands such text on.

    Args:
        body: the request JSON object.
        tokenizer: resolves text keys of ``logit_bias`` (may be None).
        max_tokens_keys: fields read as n_predict, first present wins
            (``("n_predict", "max_tokens")`` on ``/completion``,
            ``("max_completion_tokens", "max_tokens")`` on chat...).
        max_logprobs: ``--max-logprobs``: the largest ``n_probs`` allowed (-1: the
            vocabulary size, vLLM's "no cap").

    Whether ``n_predict`` is a default the face applied rather than the client's own limit is
    not a body field: the request carries it (``ChatRequest.n_predict_is_default``,
    ``CompletionRequest.n_predict_is_default``) and the plan sets
    ``SamplingParams.n_predict_default`` from it.

    Output constraints (``grammar``, ``json_schema``, ``response_format``,
    ``structured_outputs``...) are not sampling parameters: faces read them with
    :func:`kvserve.structured.spec.constraint_from_body`.

    Raises:
        ApiError: 400 on a wrong type or an out-of-range value.
    """
    check_text(body)
    kw: dict[str, Any] = {}
    for key, attr in _NUMBER_FIELDS.items():
        v = get_number(body, key)
        if v is not None:
            if not math.isfinite(v):
                raise ApiError(400, f"Field '{key}': must be a finite number")
            kw[attr] = v
    for key in _UNUSED_NUMBER_FIELDS:
        v = get_number(body, key)
        if v is not None and not math.isfinite(v):
            raise ApiError(400, f"Field '{key}': must be a finite number")
    for key, attr in _INT_FIELDS.items():
        v = get_int(body, key)
        if v is not None:
            kw[attr] = v
    for key, attr in _BOOL_FIELDS.items():
        v = get_bool(body, key)
        if v is not None:
            kw[attr] = v
    if kw.get("top_k", 0) < 0:
        kw["top_k"] = 0  # llama.cpp: top_k <= 0 disables the sampler
    for key in max_tokens_keys:
        v = get_int(body, key)
        if v is not None:
            kw["n_predict"] = v
            break
    seed = get_int(body, "seed")
    if seed is not None:
        kw["seed"] = SEED_RANDOM if seed < 0 else seed & 0xFFFFFFFF
    if body.get("stop") is not None:
        kw["stop"] = stop_strings(body["stop"])
    if body.get("samplers") is not None:
        kw["samplers"] = _samplers(body["samplers"])
    if body.get("dry_sequence_breakers") is not None:
        kw["dry_sequence_breakers"] = _dry_breakers(body["dry_sequence_breakers"])
    lb = body.get("logit_bias")
    if lb is not None:
        kw["logit_bias"] = parse_logit_bias(lb, tokenizer)
    if "n_probs" in kw:
        check_logprobs(kw["n_probs"], max_logprobs, getattr(tokenizer, "n_vocab", None))
    return kw


def check_logprobs(n: int, max_logprobs: int, n_vocab: int | None, *, prompt: bool = False) -> None:
    """Refuse more top candidates per token than ``--max-logprobs`` (vLLM's check and wording).

    Args:
        n: requested candidates (``n_probs``, ``top_logprobs``, ``logprobs``).
        max_logprobs: the cap; -1 means the vocabulary size (``n_vocab``; no cap when unknown).
        prompt: the request's prompt logprobs (vLLM says "prompt logprobs").

    Raises:
        ApiError: 400 ``Requested sample logprobs of 1000, which is greater than max allowed: 20``.
    """
    cap = max_logprobs if max_logprobs >= 0 else n_vocab
    if cap is not None and n > cap:
        kind = "prompt" if prompt else "sample"
        raise ApiError(400, f"Requested {kind} logprobs of {n}, which is greater than max allowed: {cap}")


def slot_view(grammar: str = ""):
    """``/slots``' view of a running request (for :func:`kvserve.serving.choices.run_choices`):
    :func:`params_to_dict` of its sampling parameters, with the request's ``grammar`` text."""
    return lambda request: params_to_dict(request.params, grammar=grammar, lora=request.lora)


def lora_field(body: dict) -> list[tuple[int, float]] | None:
    """llama-server's per-request ``lora``: ``[{"id": N, "scale": S}, ...]`` -> ``[(N, S), ...]``; None
    when absent or null (the runner's global scales apply). Adapters not listed get scale 0, as in
    llama-server; ids and scales are checked against the runner's adapters when the request is
    planned (kvserve.lora.LoraRegistry.resolve: unknown id, NaN, out of range: 400).

    Raises ApiError 400: not an array of objects, an ``id`` that is not an integer, a ``scale`` that is
    not a number (a missing ``scale`` is 0, as llama-server's)."""
    value = body.get("lora")
    if value is None:
        return None
    msg = "Error: 'lora' must be an array of objects with 'id' and 'scale' fields"
    if not isinstance(value, list) or len(value) > 1024:
        raise ApiError(400, msg)
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise ApiError(400, msg)
        aid, scale = item.get("id"), item.get("scale", 0.0)
        if isinstance(aid, bool) or not isinstance(aid, int):
            raise ApiError(400, f"{msg}: 'id' must be an integer, got {json.dumps(aid)[:40]}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ApiError(400, f"{msg}: 'scale' must be a number, got {json.dumps(scale)[:40]}")
        out.append((aid, float(scale)))
    return out


def params_to_dict(p: SamplingParams, *, stream: bool = False, grammar: str = "", lora=()) -> dict:
    """llama-server's ``generation_settings`` / ``/slots`` ``params`` object for ``p``.

    Args:
        grammar: the request's grammar text (``GrammarBackend.grammar_text``), "" without one.
        lora: the LoRA adapters the request applies (``Request.lora``: ``(id, scale)`` pairs), shown as
            ``lora: [{"id", "scale"}]`` (llama-server shows the request's own list; kvserve the
            adapters in effect, the global scales included, zero scales left out).
    """
    # -inf is written false (llama-server's input form); +inf null (what nlohmann writes for it)
    bias = [[tid, b if math.isfinite(b) else (False if b < 0 else None)] for tid, b in sorted(p.logit_bias.items())]
    return {
        "n_predict": p.n_predict,
        "seed": p.seed,
        "temperature": p.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "stop": list(p.stop),
        "max_tokens": p.n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": p.ignore_eos,
        "stream": stream,
        "logit_bias": bias,
        "n_probs": p.n_probs,
        "min_keep": 0,
        "min_tokens": p.min_tokens,
        "grammar": grammar,
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "thinking_forced_open": False,
        "samplers": list(p.samplers),
        # the values in effect: the server's (--draft-max, --draft-p-min: SamplingParams defaults from
        # ServerArgs.default_sampling_params) unless the request lowered them
        "speculative.n_max": 16 if p.spec_n_max is None else p.spec_n_max,
        "speculative.n_min": p.spec_n_min,
        "speculative.p_min": 0.0 if p.spec_p_min is None else p.spec_p_min,
        "timings_per_token": False,
        "post_sampling_probs": p.post_sampling_probs,
        "cache_prompt": p.cache_prompt,
        "lora": [{"id": aid, "scale": s} for aid, s in lora],
    }
