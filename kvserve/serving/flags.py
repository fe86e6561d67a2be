"""The one table of ``kvserve serve`` flags: every flag, its spellings (llama-server's short and
long names, vLLM's names), type, default, environment variables, help, the tool it comes from,
and what kvserve does with it. The parser (:mod:`kvserve.serving.args`), ``--help`` and the
README table (``python -m kvserve.serving.flags --markdown``) are generated from it.

What kvserve does with a flag (:attr:`Flag.effect`):

* ``real``: it does what the flag says (:attr:`Flag.why` says how, where kvserve differs);
* ``no effect``: accepted; when given, one INFO log line names the flag and why it means
  nothing here (a GPU layer count on a CPU, continuous batching that is always on, ...);
* ``not available``: accepted; when given, one WARNING names the flag and what is missing
  (a feature kvserve does not have yet, such as a draft model); the server starts without it;
* ``refused``: the server does not start: exit status 2 and a message saying why.

A flag may also refuse some values only (:attr:`Flag.check`: ``-tp 2``, ``-ctk q4_1``,
``--port 70000``); the check's text is the error message, word for word. :attr:`Flag.config`
turns a checked value into its :class:`~kvserve.serving.args.ServerArgs` field (``--seed -1``:
random, ``--keep-alive 5m``: 300.0 s). Rules that join several flags live in
:mod:`kvserve.serving.args`.

Short flags parse as llama-server parses them: ``-ngl 99`` is ``-ngl``, never ``-n gl``
(argparse's single-dash clustering and prefix matching are off: an unknown ``-xyz`` is an
unknown flag). Environment variables (llama-server's ``LLAMA_ARG_*``, vLLM's ``VLLM_*`` where
they set a serving option, Ollama's and kvserve's own) apply when the command line does not
give the flag; booleans take llama-server's ``true/1/on/enabled`` and ``false/0/off/disabled``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REAL, NONE, WARN, REFUSE = "real", "no effect", "not available", "refused"
LLAMA, VLLM, BOTH, KV, OLLAMA = "llama-server", "vLLM", "llama-server, vLLM", "kvserve", "Ollama"

_TRUE = {"1", "true", "on", "enabled", "yes"}
_FALSE = {"0", "false", "off", "disabled", "no"}


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag of ``kvserve serve``.

    Attributes:
        names: its spellings, e.g. ``("-ngl", "--n-gpu-layers", "--gpu-layers")``.
        dest: the parsed value's key (the :class:`~kvserve.serving.args.ServerArgs` attribute
            for real flags, where one exists).
        kind: ``str`` | ``int`` | ``float`` | ``bool`` (no value: True; ``neg`` names give
            False) | ``opt`` (an optional value, ``const`` when absent, e.g. ``-fa [on|off]``) |
            ``list`` (one or more values) | ``append`` (repeatable).
        default: the value when neither the command line nor the environment gives one.
        help: one line for ``--help``.
        source: the tool whose flag this is (:data:`LLAMA`, :data:`VLLM`, :data:`BOTH`,
            :data:`KV`, :data:`OLLAMA`).
        effect / why: what kvserve does (module docstring) and the reason the log line gives.
        env: environment variables naming this flag (the first set one wins).
        neg / neg_effect / neg_why: the negative spellings of a ``bool`` flag and their effect
            (default: the flag's own).
        choices: the values accepted (None: any).
        const: the value of an ``opt`` flag given without one.
        metavar: the value's name in ``--help``.
        check: ``value -> error text or None``: values refused although the flag is accepted (the
            server does not start: exit status 2, the text after the usage, or alone for a
            :class:`Plain` text). It runs on values given by the command line or the environment.
        convert: ``text -> value`` in place of the kind's conversion (raises ValueError).
        config: ``value -> ServerArgs value`` of the field named ``dest`` (default: the value as
            it is), applied after the checks pass.
    """

    names: tuple[str, ...]
    dest: str
    kind: str = "str"
    default: Any = None
    help: str = ""
    source: str = LLAMA
    effect: str = REAL
    why: str = ""
    env: tuple[str, ...] = ()
    neg: tuple[str, ...] = ()
    neg_effect: str | None = None
    neg_why: str = ""
    choices: tuple[str, ...] | None = None
    const: Any = None
    metavar: str | None = None
    check: Callable[[Any], str | None] | None = None
    convert: Callable[[str], Any] | None = None
    config: Callable[[Any], Any] | None = None

    @property
    def spelled(self) -> str:
        """Every spelling, negatives included, comma-separated (``-cb, --cont-batching, -nocb, ...``)."""
        return ", ".join(self.names + self.neg)

    def effect_for(self, negative: bool) -> tuple[str, str]:
        """``(effect, why)`` of the positive or the negative spelling."""
        if negative and self.neg_effect is not None:
            return self.neg_effect, self.neg_why or self.why
        return self.effect, self.why

    def to_value(self, text: str) -> Any:
        """Convert one command-line or environment text. Raises ValueError."""
        if self.convert is not None:
            return self.convert(text)
        if self.kind == "int":
            return int(text)
        if self.kind == "float":
            return float(text)
        if self.kind == "bool":
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {text!r}")
        return text


# -- value forms ----------------------------------------------------------------------------

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*")


def human_int(text: str) -> int:
    """vLLM's human-readable integers: ``32768``, ``32k`` (32,000), ``32K`` (32,768), ``1m``
    (10**6), ``1M`` (2**20), ``25.6k``; lower-case suffixes are decimal, upper-case binary.

    Raises:
        ValueError: not such a number (an upper-case suffix takes a whole number).
    """
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid number {text!r}: an integer, optionally with k/m/g/t (decimal) or K/M/G/T "
                         "(binary)")
    num, unit = m.groups()
    if unit and unit.isupper():
        if "." in num:
            raise ValueError(f"invalid number {text!r}: a binary suffix ({unit}) takes a whole number")
        return int(num) << (10 * "KMGT".index(unit) + 10)
    mult = 10 ** (3 * ("kmgt".index(unit) + 1)) if unit else 1
    return int(float(num) * mult) if unit else int(num)


def memory_bytes(text: str) -> int:
    """``--kv-cache-memory-bytes``: a human-readable integer (:func:`human_int`: ``4G`` = 4 GiB,
    ``4g`` = 4 * 10**9) or a size with a unit: ``4GiB`` (binary), ``4GB`` (decimal), ``512MiB``.

    Raises:
        ValueError: not such a size.
    """
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT])(i?)[bB]", t)
    if m is not None:
        num, unit, binary = m.groups()
        if binary:
            return int(float(num) * (1 << (10 * "KMGT".index(unit.upper()) + 10)))
        return int(float(num) * 10 ** (3 * ("KMGT".index(unit.upper()) + 1)))
    return human_int(t)


def max_model_len(text: str) -> int:
    """``--max-model-len``: a human-readable integer, or ``auto``/``-1`` (the model's own: 0)."""
    if text.strip().lower() == "auto" or text.strip() == "-1":
        return 0
    return human_int(text)


def json_object(text: str) -> dict:
    """A JSON object given as text. Raises ValueError."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")  # noqa: TRY004 - argparse converters raise ValueError
    return value


def string_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's ``--allowed-origins '["*"]'``) or a comma-separated list."""
    stripped = text.strip()
    if stripped.startswith("["):
        value = json.loads(stripped)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("expected a JSON list of strings")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def _parallel_check(what: str, flag: str) -> Callable[[Any], str | None]:
    """``-tp N`` / ``-pp N``: at least 1 (the model's head and layer checks run at start-up,
    kvserve.serving.startup_checks; the ranks: kvserve.engine.parallel)."""
    def check(n: int) -> str | None:
        if n < 1:
            return f"{flag} must be at least 1, got {n}"
        return None
    return check


def _dp_check(n: int) -> str | None:
    """``-dp N``: kvserve does not start replicas itself; N ``kvserve serve`` processes behind
    the vLLM project's router are the way (kvserve.faces.router, README "Replicas")."""
    if n < 1:
        return f"--data-parallel-size must be at least 1, got {n}"
    if n > 1:
        return (f"--data-parallel-size {n}: kvserve does not start replicas itself; start {n} `kvserve serve` "
                f"processes on ports of their own and put vllm-router in front: vllm-router --worker-urls "
                f"http://127.0.0.1:PORT1 http://127.0.0.1:PORT2 ... --policy cache_aware --cb-failure-threshold 1 "
                f"(README: Replicas behind vLLM's router)")
    return None


_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


#: the -ctk/-ctv types kvserve stores (kvserve.engine.kv_quant)
_KV_TYPES_REAL = ("f32", "f16", "bf16", "q8_0", "q4_0")


def _kv_type_check(flag: str) -> Callable[[Any], str | None]:
    def check(v: str) -> str | None:
        if v in _KV_TYPES_REAL:
            return None
        return (f"{flag} {v}: KV cache type {v} is not available; kvserve stores K and V as "
                f"{', '.join(_KV_TYPES_REAL)} (or float8 with --kv-cache-dtype fp8)")
    return check


def _kv_dtype_check(v: str) -> str | None:
    if v in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        return None
    what = {"fp8_inc": "Intel Gaudi's float8 KV cache (fp8_inc, via Intel Neural Compressor)",
            "fp8_ds_mla": "DeepSeek's MLA float8 layout (fp8_ds_mla)"}.get(v, v)
    return (f"--kv-cache-dtype {v}: {what} is not available in kvserve; use auto, bfloat16, fp8, fp8_e4m3 or "
            "fp8_e5m2")


#: --spec-type values: kvserve's prompt lookup under its names, and off
SPEC_TYPES = ("ngram", "ngram-simple", "none")


def _spec_type_check(v: str) -> str | None:
    if v in SPEC_TYPES:
        return None
    return (f"--spec-type {v}: not available; kvserve has ngram (prompt lookup, llama-server's ngram-simple) "
            "and none")


_SPEC_CONFIG_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
#: vLLM's keys kvserve takes for a draft model (method "draft_model", or a "model" without a method)
_SPEC_DRAFT_KEYS = {"method", "model", "num_speculative_tokens"}


def _spec_config_check(cfg: dict) -> str | None:
    from kvserve.engine.spec_decode import MAX_NUM_SPECULATIVE_TOKENS, MAX_PROMPT_LOOKUP

    method = cfg.get("method")
    if method is None and "model" not in cfg:
        # vLLM's SpeculativeConfig: "num_speculative_tokens was provided but without speculative model."
        what = ("num_speculative_tokens was provided but without speculative model"
                if "num_speculative_tokens" in cfg else "no speculative method or model")
        return (f"--speculative-config: {what}: give \"method\" (ngram: prompt lookup, or draft_model) or "
                "\"model\" (a draft model)")
    v = cfg.get("num_speculative_tokens")
    if isinstance(v, int) and not isinstance(v, bool) and v > MAX_NUM_SPECULATIVE_TOKENS:
        return (f"--speculative-config: num_speculative_tokens must be at most {MAX_NUM_SPECULATIVE_TOKENS}, "
                f"got {v} (a step verifies fewer anyway: its rows cap the draft)")
    if method == "draft_model" or (method is None and "model" in cfg):
        extra = sorted(set(cfg) - _SPEC_DRAFT_KEYS)
        if extra:
            return f"--speculative-config: unsupported key(s) {', '.join(extra)} for a draft model"
        if not isinstance(cfg.get("model"), str) or not cfg["model"]:
            return "--speculative-config: a draft model needs \"model\" (a .gguf path, HF directory or store name)"
        v = cfg.get("num_speculative_tokens")
        if v is None:
            return "--speculative-config: num_speculative_tokens is required for a draft model"
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"--speculative-config: num_speculative_tokens must be a positive integer, got {v!r}"
        return None
    if method != "ngram" or "model" in cfg:
        what = f"method {method!r}" if method != "ngram" else "a draft model with method ngram"
        return (f"--speculative-config: {what} is not available; kvserve has methods ngram (prompt lookup) "
                "and draft_model")
    extra = sorted(set(cfg) - _SPEC_CONFIG_KEYS)
    if extra:
        return f"--speculative-config: unsupported key(s) {', '.join(extra)} for method ngram"
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f"--speculative-config: {key} must be a positive integer, got {v!r}"
    if cfg.get("num_speculative_tokens") is None:
        return "--speculative-config: num_speculative_tokens is required for method ngram"
    lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
    if lo is not None and hi is not None and lo > hi:
        return f"--speculative-config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if cfg.get(key) is not None and cfg[key] > MAX_PROMPT_LOOKUP:
            return (f"--speculative-config: {key} must be at most {MAX_PROMPT_LOOKUP} (tokens), got {cfg[key]} "
                    "(the n-gram index holds a tuple of n tokens per position and n)")
    return None


def _at_most_lookup(n: int) -> str | None:
    from kvserve.engine.spec_decode import MAX_PROMPT_LOOKUP

    return None if n <= MAX_PROMPT_LOOKUP else f"--spec-ngram-size-n must be at most {MAX_PROMPT_LOOKUP}, got {n}"


def _draft_max_check(n: int, flag: str = "--draft-max") -> str | None:
    from kvserve.engine.spec_decode import MAX_NUM_SPECULATIVE_TOKENS

    if not 0 <= n <= MAX_NUM_SPECULATIVE_TOKENS:
        return (f"{flag} must be in [0, {MAX_NUM_SPECULATIVE_TOKENS}], got {n} (a step verifies fewer "
                "anyway: its rows cap the draft)")
    return None


def _generation_config_check(v: str) -> str | None:
    from kvserve.serving.generation_config import check_generation_config

    return check_generation_config(v)


def _quantization_check(v: str) -> str | None:
    from kvserve.serving.startup_checks import quantization_name_error

    return quantization_name_error(v)


def _positive(flag: str) -> Callable[[Any], str | None]:
    return lambda n: None if n >= 1 else f"{flag} must be at least 1, got {n}"


def _non_negative(flag: str) -> Callable[[Any], str | None]:
    return lambda n: None if n >= 0 else f"{flag} must be >= 0, got {n}"


def _ngl_value(text: str) -> str:
    if text in ("auto", "all") or text.lstrip("-").isdigit():
        return text
    raise ValueError(f"expected a number, 'auto' or 'all', got {text!r}")


#: vLLM's ``MaxLoRARanks``: the values ``--max-lora-rank`` takes
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_rank_check(n: int) -> str | None:
    return None if n in MAX_LORA_RANKS else \
        f"invalid --max-lora-rank {n}: one of {', '.join(map(str, MAX_LORA_RANKS))} (vLLM's values)"


# -- checks of single values (the error text is the contract: seeds and tests hold it) -------

class Plain(str):
    """A check's error text printed as it is, without the usage and ``error:`` lines argparse adds
    (llama-server's ``error while handling argument ...`` lines); the exit status is 2 all the same."""


def _at_least(flag: str, low: int | float, what: str) -> Callable[[Any], str | None]:
    """``invalid FLAG N: WHAT`` below ``low``."""
    return lambda n: f"invalid {flag} {n}: {what}" if n < low else None


def lora_paths(values: list[str] | None) -> list[str]:
    """``--lora`` values (each comma-separated, as llama-server's) -> the adapter paths, in order."""
    return [p for v in values or [] for p in v.split(",") if p]


def lora_scaled(values: list[str] | None) -> list[tuple[str, float]]:
    """``--lora-scaled FNAME:SCALE,...`` values -> (path, scale) pairs, in order. Raises ValueError
    on an item without ``:SCALE`` or a scale that is not a finite number of at most 1000 in size
    (kvserve.lora.MAX_SCALE)."""
    out = []
    for v in values or []:
        for item in v.split(","):
            path, sep, scale = item.rpartition(":")
            if not sep or not path:
                raise ValueError(f"{item!r}: lora-scaled format: FNAME:SCALE")
            try:
                s = float(scale)
            except ValueError:
                raise ValueError(f"{item!r}: the scale {scale!r} is not a number (format: FNAME:SCALE)") from None
            if not math.isfinite(s) or abs(s) > 1000.0:
                raise ValueError(f"{item!r}: the scale must be a finite number in [-1000, 1000]")
            out.append((path, s))
    return out


def _lora_scaled_check(values) -> str | None:
    try:
        lora_scaled(values)
    except ValueError as e:
        return f"invalid --lora-scaled {e}"
    return None


def join_lora_scaled(argv: list[str]) -> list[str]:
    """llama-server's older two-word ``--lora-scaled FNAME SCALE`` -> ``--lora-scaled FNAME:SCALE`` (the
    current form), when the second word is a number. Words after a bare ``--`` are untouched."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return out + argv[i:]
        if (word == "--lora-scaled" and i + 2 < len(argv) and ":" not in argv[i + 1]
                and _is_number(argv[i + 2])):
            out += [word, f"{argv[i + 1]}:{argv[i + 2]}"]
            i += 3
            continue
        out.append(word)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _port_check(n: int) -> str | None:
    return None if 0 <= n <= 65535 else f"invalid --port value {n}: 0-65535"


def _parallel_slots_check(n: int) -> str | None:
    return None if n == -1 or n >= 1 else f"invalid -np value {n}: -1 (auto) or >= 1"


def host_list(value: Any) -> list[str]:
    """``--host`` (repeated, each comma-separated) -> the addresses, each once, in order."""
    items = value if isinstance(value, list) else [value]
    return list(dict.fromkeys(h.strip() for item in items for h in item.split(",") if h.strip()))


def _host_check(value: Any) -> str | None:
    hosts = host_list(value)
    if not hosts:
        return "invalid --host: no address given"
    sock_paths = [h for h in hosts if h.endswith(".sock") or "/" in h]
    if sock_paths:
        return f"--host {sock_paths[0]}: UNIX sockets are not supported: kvserve listens on TCP addresses"
    return None


def _tools_check(names: list[str]) -> str | None:
    """``--tools``: llama-server's start-up refusal of a name that is not a built-in tool."""
    from kvserve.tools.base import BUILTIN_NAMES

    bad = [n for n in names if n != "all" and n not in BUILTIN_NAMES]
    return Plain(f'tools setup failed: unknown tool "{bad[0]}". available tools: {", ".join(BUILTIN_NAMES)}') \
        if bad else None


def _tools_runtime_check(spec: str) -> str | None:
    """``--tools-runtime``: a running container's spec (:func:`kvserve.tools.runtime.parse_runtime`)."""
    from kvserve.tools.base import ToolRuntimeError
    from kvserve.tools.runtime import parse_runtime

    try:
        parse_runtime(spec)
    except ToolRuntimeError as e:
        return Plain(f"tools setup failed: {e.message}")
    return None


def _existing_file(flag: str) -> Callable[[str], str | None]:
    def check(path: str) -> str | None:
        return None if os.path.isfile(path) else f'error while handling argument "{flag}": no such file: {path}'
    return check


def _slot_save_path_check(path: str) -> str | None:
    if os.path.isdir(path):
        return None
    # llama-server's wording (seed Example 1); it exits at once
    return Plain(f'error while handling argument "--slot-save-path": not a directory: {path}')


def read_keys(path: str) -> list[str]:
    """``--api-key-file``: one key a line; blank lines and ``#`` comments skipped. Raises OSError."""
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def _api_key_file_check(path: str) -> str | None:
    if not path:
        return None  # "" names no file: no keys are read
    try:
        read_keys(path)
    except OSError as e:
        return f'error while handling argument "--api-key-file": {e}'
    return None


_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_memory(text: str) -> int:
    """``--max-memory``: a number of MiB, or a number with a unit (``8GiB``, ``512MB``) -> bytes.

    Raises:
        ValueError: not such a size, or not positive.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid --max-memory {text!r}: a number of MiB or a size such as 8GiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"invalid --max-memory {text!r}: must be positive")
    return value


def _error_of(parse: Callable[[Any], Any]) -> Callable[[Any], str | None]:
    """A check from a parser: its ValueError's text."""
    def check(value: Any) -> str | None:
        try:
            parse(value)
        except ValueError as e:
            return str(e)
        return None
    return check


def keep_alive_seconds(text: str) -> float:
    """``--keep-alive`` -> seconds (math.inf: forever), as Ollama's ``keep_alive``.

    Raises:
        ValueError: not a duration (``invalid --keep-alive ...``).
    """
    from kvserve.errors import InvalidInputError
    from kvserve.serving.manager import parse_keep_alive

    try:
        return parse_keep_alive(text, "--keep-alive")
    except InvalidInputError as e:
        raise ValueError(str(e).replace("Field '--keep-alive'", "invalid --keep-alive")) from None


def _tool_parser_check(name: str) -> str | None:
    from kvserve.chat.tool_parsers import tool_parser_error

    return (tool_parser_error(name) or None) if name else None


def _reasoning_parser_check(name: str) -> str | None:
    from kvserve.chat.reasoning import reasoning_parser_error

    return (reasoning_parser_error(name) or None) if name else None


def _chat_template_check(spec: str) -> str | None:
    """``--chat-template`` must be a file, a built-in name or Jinja text that compiles."""
    from kvserve.chat.builtin_templates import ChatTemplateChoiceError, resolve_chat_template
    from kvserve.chat.template import ChatTemplate, TemplateError

    try:
        _, source = resolve_chat_template(spec)
        ChatTemplate(source)
    except ChatTemplateChoiceError as e:
        return str(e)
    except (OSError, UnicodeDecodeError) as e:
        return f'error while handling argument "--chat-template": {e}'
    except TemplateError as e:
        return f"invalid --chat-template: {e}"
    return None


_SAMPLER_NAMES = {"typical_p": "typ_p", "typical": "typ_p", "temp": "temperature", "nucleus": "top_p",
                  "top-k": "top_k", "top-p": "top_p", "min-p": "min_p", "top-n-sigma": "top_n_sigma"}


def samplers(text: str) -> tuple[str, ...]:
    """``--samplers top_k;temp;...`` -> the sampler chain's names (llama-server's aliases taken).

    Raises:
        ValueError: an unknown sampler (the text names the known ones).
    """
    from kvserve.engine.request import DEFAULT_SAMPLERS

    names = tuple(_SAMPLER_NAMES.get(n.strip(), n.strip()) for n in re.split(r"[;,]", text) if n.strip())
    bad = [n for n in names if n not in DEFAULT_SAMPLERS]
    if bad:
        raise ValueError(f"invalid --samplers {text!r}: unknown sampler(s) {', '.join(bad)}; "
                         f"known: {';'.join(DEFAULT_SAMPLERS)}")
    return names


def logit_bias(items: list[str]) -> dict[int, float]:
    """``-l 15043+1 -l 2-inf,3+0.5`` -> ``{token id: bias}``.

    Raises:
        ValueError: an item not ``TOKEN_ID(+/-)BIAS``.
    """
    out: dict[int, float] = {}
    for item in items:
        for part in item.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*([+-]\s*(?:inf|\d+(?:\.\d+)?))\s*", part, re.IGNORECASE)
            if m is None:
                raise ValueError(f"invalid --logit-bias {part!r}: TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 2-inf")
            out[int(m.group(1))] = float(m.group(2).replace(" ", ""))
    return out


#: --override-generation-config keys (vLLM / HF generation_config names) -> ServerArgs fields
GEN_KEYS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty", "max_new_tokens": "n_predict", "max_tokens": "n_predict"}
#: --override-generation-config keys that become SamplingParams defaults
GEN_SAMPLING = frozenset({"presence_penalty", "frequency_penalty"})


def is_number(value: Any) -> bool:
    """A JSON number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def generation_value(key: str, value: int | float) -> Any:
    """One ``--override-generation-config`` number (``key`` in :data:`GEN_KEYS`), checked as a
    model's generation_config.json is.

    Raises:
        ValueError: a value the model's file would not be allowed (``invalid --override-...``).
    """
    from kvserve.serving.generation_config import check_value

    name = GEN_KEYS[key]
    try:  # the checks the model's file gets; refused here, since the user typed it
        return check_value({"temp": "temperature"}.get(name, name), value)
    except ValueError as e:
        raise ValueError(f"invalid --override-generation-config: {key} = {value!r}: {e}") from None


def generation_overrides(cfg: dict) -> dict[str, Any]:
    """``--override-generation-config``'s numbers for ServerArgs fields (``temp``, ``top_k``,
    ``n_predict``...): :func:`generation_value` of each, the last key of a field winning.

    Raises:
        ValueError: a value refused (:func:`generation_value`), or a temperature not finite.
    """
    import math

    gen = {GEN_KEYS[k]: generation_value(k, v) for k, v in cfg.items() if k in GEN_KEYS and is_number(v)}
    if not math.isfinite(gen.get("temp", 0.0)):
        raise ValueError("invalid --override-generation-config: temperature must be finite")
    return gen


# -- ServerArgs values of single flags (Flag.config) ------------------------------------------

def device_name(text: str) -> str:
    """``--device``: kvserve's auto/cpu/cuda[:N]; llama-server's ``none`` and ``CUDA0[,CUDA1]``."""
    first = text.split(",")[0].strip()
    if first.lower() == "none":
        return "cpu"
    m = re.fullmatch(r"(?i)cuda(\d+)", first)
    return f"cuda:{m.group(1)}" if m else first


def _seed(n: int) -> int:
    """``-s N``: a negative seed is random; others as llama-server's uint32."""
    from kvserve.engine.request import SEED_RANDOM

    return SEED_RANDOM if n < 0 else n & 0xFFFFFFFF


def _api_prefix(text: str | None) -> str:
    """``--api-prefix``: ``/pfx`` for ``pfx``, ``/pfx/`` or ``/pfx``; ``""`` for none or ``/``."""
    p = (text or "").strip().strip("/")
    return f"/{p}" if p else ""


# -- the table ------------------------------------------------------------------------------

def _dest(names: tuple[str, ...]) -> str:
    longs = [n for n in names if n.startswith("--")]
    return (longs[0] if longs else names[0]).lstrip("-").replace("-", "_")


def F(names: str, kind: str = "str", default: Any = None, help: str = "", source: str = LLAMA,
      effect: str = REAL, why: str = "", env: str = "", neg: str = "", dest: str | None = None, **kw) -> Flag:
    """A table row: ``names``, ``env`` and ``neg`` are space-separated spellings."""
    t = tuple(names.split())
    return Flag(t, dest or _dest(t), kind, default, help, source, effect, why, tuple(env.split()),
                tuple(neg.split()), **kw)


_NO_GPU_LAYERS = "every layer runs on the one device kvserve uses (--device); -ngl 0 means the CPU"
_CPU_AFFINITY = "torch picks its threads' CPUs; -t sets how many"
_DRAFT = ("a draft model from the hub is not fetched at start: kvserve pull it and pass -md NAME; the server "
          "runs without a draft")
_ROPE = "the model file's RoPE parameters are used"
_NO_MM = "kvserve serves text only: requests with image or audio parts are refused"
_LOG_SHAPE = "kvserve logs in llama-server's line shape to stderr (--log-file adds a file)"

def _parser(flag: str):
    """The value parser of ``--remote`` (:func:`kvserve.remote.parse_remote`) or ``--engine``
    (:func:`kvserve.supervisor.parse_engine`), imported only when the flag is given: neither module
    (nor httpx) is on the start-up path otherwise."""
    if flag == "--remote":
        from kvserve.remote.spec import parse_remote

        return parse_remote
    from kvserve.supervisor.spec import parse_engine

    return parse_engine


def _named_models_check(flag: str):
    """A ``check`` for ``--remote`` / ``--engine``: each value parses and names its model once."""
    def check(values: list[str]) -> str | None:
        from kvserve.errors import InvalidInputError

        if not values:
            return None
        parse, seen = _parser(flag), set()
        for v in values:
            try:
                name = parse(v).name
            except InvalidInputError as e:
                return f"invalid {flag}: {e}"
            if name in seen:
                return f"invalid {flag}: model '{name}' is given twice"
            seen.add(name)
        return None
    return check


def _named_models_config(flag: str):
    """A ``config`` for ``--remote`` / ``--engine``: the parsed specs ([] without the flag)."""
    def config(values: list[str] | None) -> list:
        return [_parser(flag)(v) for v in values] if values else []
    return config


#: every flag of ``kvserve serve``, in ``--help`` order within each source
FLAGS: tuple[Flag, ...] = (
    # -- the model
    F("-m --model", help="model name, .gguf path or HF directory", source=BOTH, env="LLAMA_ARG_MODEL",
      why="a store name (kvserve pull), a .gguf file or an HF directory; vLLM's positional MODEL too"),
    F("-a --alias", help="model name(s) for the API, comma-separated", env="LLAMA_ARG_ALIAS"),
    F("--served-model-name", "list", help="model name(s) for the API", source=VLLM),
    F("-hf -hfr --hf-repo", help="<user>/<model>[:quant]: the store model hf.co/<user>/<model>[:quant]",
      env="LLAMA_ARG_HF_REPO", metavar="REPO",
      why="served from the store as hf.co/<user>/<model>[:quant]; pull it first with kvserve pull"),
    F("-hff --hf-file", help="file of the -hf repository", env="LLAMA_ARG_HF_FILE", effect=WARN,
      why="the store picks the file by the repository's quant tag (-hf user/model:Q4_K_M)"),
    F("-hft --hf-token", help="Hugging Face token", effect=NONE,
      why="kvserve downloads nothing at start-up but the known default models"),
    F("-mu --model-url", help="model download URL", env="LLAMA_ARG_MODEL_URL", effect=REFUSE,
      why="kvserve does not download from URLs: kvserve pull NAME, or -m with a .gguf file"),
    F("-dr --docker-repo", help="Docker Hub model", env="LLAMA_ARG_DOCKER_REPO", effect=REFUSE,
      why="kvserve does not pull from Docker Hub: kvserve pull NAME, or -m with a .gguf file"),
    F("--offline", "bool", False, "never download: a model missing from the store is an error",
      env="LLAMA_ARG_OFFLINE HF_HUB_OFFLINE", why="no pull at start-up (the default model must be in the store)"),
    F("--models-dir", help="model store in Ollama's layout (manifests/ + blobs/)",
      env="LLAMA_ARG_MODELS_DIR", why="kvserve's store (default $OLLAMA_MODELS, else $KVSERVE_HOME/models); "
      "llama-server's router reads .gguf files from it"),
    F("--models-max", "int", help="most models loaded at once (0: no limit)", env="LLAMA_ARG_MODELS_MAX",
      why="as --max-loaded-models"),
    F("--models-preset", help="INI model presets", env="LLAMA_ARG_MODELS_PRESET", effect=WARN,
      why="model presets are not read; every store model loads with the server's flags"),
    F("--models-autoload", "bool", help="load models on demand", neg="--no-models-autoload",
      env="LLAMA_ARG_MODELS_AUTOLOAD", effect=NONE, why="models always load on demand",
      neg_effect=WARN, neg_why="models always load on their first request"),
    F("--tokenizer", help="tokenizer name or path", source=VLLM, effect=WARN,
      why="the model's own tokenizer (GGUF or tokenizer.json) is used"),
    F("--tokenizer-mode", help="tokenizer mode", source=VLLM, effect=NONE, why="one tokenizer implementation"),
    F("--revision", help="model revision", source=VLLM, effect=NONE, why="models are files or store names"),
    F("--code-revision", source=VLLM, effect=NONE, why="kvserve runs no model code from the hub"),
    F("--tokenizer-revision", source=VLLM, effect=NONE, why="models are files or store names"),
    F("--download-dir", help="download directory", source=VLLM, effect=NONE,
      why="downloads go to the store (--models-dir)"),
    F("--load-format", help="weights format", source=VLLM, effect=NONE,
      why="the format is read from the model (GGUF or safetensors)"),
    F("--trust-remote-code", "bool", False, source=VLLM, effect=NONE,
      why="kvserve runs no model code from the hub"),
    F("--hf-overrides", source=VLLM, effect=WARN, why="the model's config is used as stored"),
    F("--hf-config-path", source=VLLM, effect=NONE, why="the config is read next to the weights"),
    F("--config", help="YAML file of flags (vLLM); the command line overrides it", source=VLLM,
      why="its keys are long flag names without the dashes"),
    F("--override-kv", help="override model metadata", effect=WARN, why="model metadata is read as stored"),
    F("--check-tensors", "bool", False, effect=NONE, why="tensors are checked as they are read"),
    # -- context, slots, batching
    F("-c --ctx-size", "int", 0, "total context in tokens (0 = the model's)",
      env="LLAMA_ARG_CTX_SIZE OLLAMA_CONTEXT_LENGTH"),
    F("--max-model-len", "int", 0, "max context of one sequence: 32768, 32k, 32K, 1m, auto, -1", source=VLLM,
      convert=max_model_len,
      why="caps one sequence's context (auto and -1: the model's); above the model's max_position_embeddings "
      "(GGUF context_length) the server does not start (vLLM's error) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
      "(vLLM's warning; the context grows to it); -c may exceed it with llama-server's warning"),
    F("-np --parallel", "int", None, "slots (-1 = auto: 4, unified KV)",
      env="LLAMA_ARG_N_PARALLEL OLLAMA_NUM_PARALLEL", check=_parallel_slots_check),
    F("--max-num-seqs", "int", None, "slots (vLLM name of -np)", source=VLLM,
      why="slots (-np wins) sharing one KV pool, each up to max_model_len (as -kvu; -np splits -c among slots); "
      "given, vLLM's checks apply: max_num_batched_tokens >= max_num_seqs (else the server "
      "does not start) and a warning when it exceeds max_num_seqs * max_model_len", check=_positive("--max-num-seqs")),
    F("-b --batch-size", "int", None, "tokens per step (= --max-num-batched-tokens)", env="LLAMA_ARG_BATCH"),
    F("--max-num-batched-tokens", "int", None, "tokens per step", source=VLLM, convert=human_int,
      why="each step's token budget (-b wins); given, vLLM's checks apply as for --max-num-seqs",
      check=_positive("--max-num-batched-tokens")),
    F("-ub --ubatch-size", "int", 512, "physical batch size", env="LLAMA_ARG_UBATCH", effect=NONE,
      why="one step is one batch here (-b)"),
    F("-kvu --kv-unified", "bool", None, "one KV pool shared by every slot", neg="-no-kvu --no-kv-unified",
      env="LLAMA_ARG_KV_UNIFIED", why="every sequence may use the whole -c context (default: on with -np auto)"),
    F("--kv-unified-per-slot", "int", help="context limit per slot", env="LLAMA_ARG_KV_UNIFIED_PER_SLOT",
      effect=WARN, why="not available: use --max-model-len to cap one sequence"),
    F("-cb --cont-batching", "bool", True, "continuous batching", neg="-nocb --no-cont-batching",
      env="LLAMA_ARG_CONT_BATCHING", effect=NONE, why="continuous batching is always on",
      neg_effect=WARN, neg_why="continuous batching cannot be turned off"),
    F("--enable-chunked-prefill", "bool", True, "chunked prefill", neg="--no-enable-chunked-prefill",
      source=VLLM, effect=NONE, why="prefill is always chunked by --max-num-batched-tokens",
      neg_effect=WARN, neg_why="prefill is always chunked by --max-num-batched-tokens"),
    F("--max-num-partial-prefills", "int", source=VLLM, effect=NONE, why="the scheduler fills each step's budget"),
    F("--max-long-partial-prefills", "int", source=VLLM, effect=NONE, why="the scheduler fills each step's budget"),
    F("--long-prefill-token-threshold", "int", source=VLLM, effect=NONE,
      why="the scheduler fills each step's budget"),
    F("--scheduling-policy", source=VLLM, choices=("fcfs", "priority"), effect=NONE,
      why="requests run first come, first served", check=lambda v: None),
    F("--async-scheduling", "bool", False, source=VLLM, effect=NONE, why="one engine thread schedules and runs"),
    F("--block-size", "int", 16, "tokens per KV block", source=VLLM, why="the KV cache's block size",
      check=lambda n: None if 1 <= n <= 1024 else f"--block-size must be between 1 and 1024, got {n}"),
    F("--enable-prefix-caching", "bool", True, "reuse cached prompt prefixes", neg="--no-enable-prefix-caching",
      source=VLLM, effect=NONE, why="prefix caching is always on",
      neg_effect=REAL, neg_why="requests reuse no cached prefix (a llama-server request may still ask "
      "cache_prompt: true)"),
    F("--prefix-caching-hash-algo", source=VLLM, effect=NONE, why="kvserve's block hash chain is fixed"),
    F("--cache-prompt", "bool", True, "reuse the KV of cached prompts", neg="--no-cache-prompt",
      env="LLAMA_ARG_CACHE_PROMPT", why="the default of each request's cache_prompt"),
    F("-cram --cache-ram", "int", None, "host prompt cache in MiB (-1 no limit, 0 off)", env="LLAMA_ARG_CACHE_RAM",
      why="default: min(8192, a quarter of MemAvailable)"),
    F("--cache-reuse", "int", 0, "min chunk size to reuse from the cache by KV shifting",
      env="LLAMA_ARG_CACHE_REUSE"),
    F("--cache-idle-slots", "bool", True, "keep idle slots' KV in the prompt cache", neg="--no-cache-idle-slots",
      env="LLAMA_ARG_CACHE_IDLE_SLOTS", effect=NONE,
      why="an idle slot's KV stays cached and moves to the host tier when its blocks are needed"),
    F("-sps --slot-prompt-similarity", "float", 0.10, "prompt similarity for slot reuse"),
    F("-ctxcp --ctx-checkpoints --swa-checkpoints", "int", env="LLAMA_ARG_CTX_CHECKPOINTS", effect=NONE,
      why="the paged KV cache keeps every block; no checkpoints are needed"),
    F("-cms --checkpoint-min-step", "int", env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", effect=NONE,
      why="the paged KV cache keeps every block; no checkpoints are needed"),
    F("--swa-full", "bool", False, env="LLAMA_ARG_SWA_FULL", effect=NONE, why="the KV cache is always full-size"),
    F("--context-shift", "bool", False, "shift the context when it fills", neg="--no-context-shift",
      env="LLAMA_ARG_CONTEXT_SHIFT", effect=WARN,
      why="context shift is not available: a sequence that fills its context stops (finish_reason length)",
      neg_effect=NONE, neg_why="kvserve never shifts the context"),
    F("--keep", "int", help="tokens kept by context shift", effect=NONE, why="kvserve never shifts the context"),
    F("-dt --defrag-thold", "float", env="LLAMA_ARG_DEFRAG_THOLD", effect=NONE, why="a paged KV cache needs no defrag"),
    F("--swap-space", "float", source=VLLM, effect=NONE, why="unreferenced KV blocks go to the host tier (--cache-ram)"),
    F("--cpu-offload-gb", "float", source=VLLM, effect=NONE, why="weights stay on the one device"),
    F("--gpu-memory-utilization", "float", 0.92, "share of device memory for weights, activations and KV",
      source=VLLM, why="given, on CUDA: the KV pool gets this share of the device's memory less what is in use "
      "after loading the weights and an activation estimate (too little for one max_model_len request: vLLM's "
      "error); no effect on the CPU (there: --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE); not given: the "
      "pool is -c x -np",
      check=lambda v: None if 0 < v <= 1 else f"--gpu-memory-utilization must be in (0, 1], got {v}"),
    F("--kv-cache-memory-bytes", "int", None, "KV cache size in bytes (4G, 4GiB, 4GB, 4294967296)", source=VLLM,
      convert=memory_bytes, check=_positive("--kv-cache-memory-bytes"),
      why="the KV pool for running sequences holds this many bytes of blocks, on any device (over -c x -np and "
      "--gpu-memory-utilization); too little for one max_model_len request: vLLM's error with the longest length "
      "that fits"),
    F("--num-gpu-blocks-override", "int", source=VLLM, check=_positive("--num-gpu-blocks-override"),
      why="the KV pool for running sequences holds this many blocks (--block-size tokens each), on any device"),
    # -- KV and weight types
    F("-ctk --cache-type-k", default="f16", help="KV cache type of K",
      env="LLAMA_ARG_CACHE_TYPE_K OLLAMA_KV_CACHE_TYPE",
      choices=_KV_TYPES, check=_kv_type_check("-ctk"),
      why="f16, bf16, f32, q8_0 (53% of f16's bytes), q4_0 (28%); the pool stores the quantized blocks "
          "(head_dim a multiple of 32); q4_1, iq4_nl, q5_0, q5_1 are refused"),
    F("-ctv --cache-type-v", default="f16", help="KV cache type of V",
      env="LLAMA_ARG_CACHE_TYPE_V OLLAMA_KV_CACHE_TYPE",
      choices=_KV_TYPES, check=_kv_type_check("-ctv"),
      why="V's own type, as -ctk: f16, bf16, f32, q8_0, q4_0; q4_1, iq4_nl, q5_0, q5_1 are refused"),
    F("--kv-cache-dtype", default="auto", help="KV cache dtype", source=VLLM,
      choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"), check=_kv_dtype_check,
      why="auto: the -ctk/-ctv types; bfloat16: as -ctk bf16 -ctv bf16; fp8 (= fp8_e4m3), fp8_e5m2: float8 "
          "K and V (50% of f16's bytes, scale 1.0); -ctk/-ctv given beside it win for their half; "
          "fp8_inc, fp8_ds_mla are refused"),
    F("--calculate-kv-scales", "bool", False, source=VLLM, effect=NONE,
      why="the fp8 KV cache uses scale 1.0 (vLLM's default without calibrated scales)"),
    F("--dtype", default="auto", help="weight/activation dtype", source=VLLM,
      choices=("auto", "float32", "bfloat16", "float16", "half", "float"),
      config=lambda d: {"half": "float16", "float": "float32"}.get(d, d),
      why="half = float16, float = float32; auto on CUDA: vLLM's rule (float16 for float32 and float16 "
      "checkpoints, bfloat16 for bfloat16; GGUF bfloat16); auto on the CPU: float32 (bfloat16 copies for large "
      "batches where the CPU has native bfloat16), logged as vLLM's Upcasting line"),
    F("-q --quantization", help="quantization method (vLLM's names)", source=VLLM, check=_quantization_check,
      why="checked against the model: a quantized config.json or GGUF file (method gguf) naming another method is "
      "vLLM's mismatch error; a config.json quantization_config is loaded without a flag (awq, gptq, "
      "compressed-tensors int4 groups stay 4-bit; int8 and fp8 are dequantized), another method is refused naming "
      "it; online methods (fp8, fp8_per_tensor, bitsandbytes, ...) on float weights: a "
      "warning, the weights are served as stored"),
    F("--large-batch-dtype", default="auto", source=KV, choices=("auto", "bfloat16", "float32"),
      help="steps above 16 rows (prefill) with --dtype auto on CPU: auto = bfloat16 where the CPU has "
           "native bf16 (GGUF blocks are then multiplied in place: llama.cpp's int8 block sums on AVX512-VNNI, "
           "bf16 for BF16 rows; no dense copy), else float32 (GGUF blocks: the per-row q8 kernels at every row "
           "count, llama.cpp's arithmetic; other weights: a dense float32 copy)"),
    # -- device and threads
    F("--device -dev", default="auto", help="auto, cpu, cuda (llama-server: none = cpu, CUDA0 = cuda:0)",
      source=BOTH, env="LLAMA_ARG_DEVICE", config=device_name),
    F("--list-devices", "bool", False, "print the devices and exit"),
    F("-ngl --gpu-layers --n-gpu-layers", help="layers on the GPU (N, auto, all)", env="LLAMA_ARG_N_GPU_LAYERS",
      convert=_ngl_value, effect=NONE, why=_NO_GPU_LAYERS),
    F("-sm --split-mode", env="LLAMA_ARG_SPLIT_MODE", effect=NONE, why="one device"),
    F("-ts --tensor-split", env="LLAMA_ARG_TENSOR_SPLIT", effect=NONE, why="one device"),
    F("-mg --main-gpu", "int", env="LLAMA_ARG_MAIN_GPU", effect=NONE, why="one device (--device cuda:N)"),
    F("-fit --fit", "opt", const="on", choices=("on", "off"), env="LLAMA_ARG_FIT", effect=NONE,
      why="the flags size the KV pool"),
    F("-fitt --fit-target", env="LLAMA_ARG_FIT_TARGET", effect=NONE, why="the flags size the KV pool"),
    F("-fitc --fit-ctx", "int", env="LLAMA_ARG_FIT_CTX", effect=NONE, why="the flags size the KV pool"),
    F("-ot --override-tensor", env="LLAMA_ARG_OVERRIDE_TENSOR", effect=NONE, why="every tensor is on the one device"),
    F("-cmoe --cpu-moe", "bool", False, env="LLAMA_ARG_CPU_MOE", effect=NONE, why="every tensor is on the one device"),
    F("-ncmoe --n-cpu-moe", "int", env="LLAMA_ARG_N_CPU_MOE", effect=NONE, why="every tensor is on the one device"),
    F("--moe-cache-mib", "int", env="LLAMA_ARG_MOE_CACHE_MIB", effect=NONE, why="every tensor is on the one device"),
    F("-ncffn --n-cpu-ffn", "int", env="LLAMA_ARG_N_CPU_FFN", effect=NONE, why="every tensor is on the one device"),
    F("--op-offload", "bool", True, neg="--no-op-offload", effect=NONE, why="every op runs on the one device"),
    F("-kvo --kv-offload", "bool", True, neg="-nkvo --no-kv-offload", env="LLAMA_ARG_KV_OFFLOAD", effect=NONE,
      why="the KV cache lives on the model's device"),
    F("--repack", "bool", True, neg="-nr --no-repack", env="LLAMA_ARG_REPACK", effect=NONE,
      why="kvserve packs weights for its own kernels"),
    F("--no-host", "bool", False, env="LLAMA_ARG_NO_HOST", effect=NONE, why="no ggml host buffers"),
    F("-fa --flash-attn", "opt", const="on", choices=("on", "off", "auto"),
      env="LLAMA_ARG_FLASH_ATTN OLLAMA_FLASH_ATTENTION", effect=NONE,
      why="attention is torch's scaled_dot_product_attention on the paged cache"),
    F("--mlock", "bool", False, effect=NONE, why="weights are not locked in memory (--mmap / --no-mmap pick how they are held)"),
    F("--mmap", "bool", None, neg="--no-mmap",
      help="GGUF weights: --mmap serves them from the file's mapping (4 KiB page-cache pages, shared with "
           "other processes); --no-mmap reads them into private memory on 2 MiB huge pages (faster decode, "
           "a copy per process). Default: --no-mmap where the kernel grants transparent huge pages, else --mmap "
           "(KVSERVE_MMAP=1/0 sets the default)"),
    F("-lm --load-mode", env="LLAMA_ARG_LOAD_MODE",
      help="llama-server's model loading mode: mmap / mmap+mlock as --mmap, none / mlock / dio as --no-mmap, "
           "auto the default (--mmap / --no-mmap win; nothing is locked in memory)"),
    F("-lzm --lazy-mode", env="LLAMA_ARG_LAZY_MODE", effect=NONE, why="--mmap / --no-mmap pick how weights are held"),
    F("--numa", env="LLAMA_ARG_NUMA", effect=NONE, why=_CPU_AFFINITY),
    F("--rpc", env="LLAMA_ARG_RPC", effect=REFUSE, why="kvserve has no RPC backend: the model runs in this process"),
    F("-t --threads", "int", 0, "CPU threads (0 = all cores)", env="LLAMA_ARG_THREADS"),
    F("-tb --threads-batch", "int", help="threads for prompt processing", effect=NONE,
      why="one torch thread pool (-t) runs prefill and decode"),
    F("-C --cpu-mask", effect=NONE, why=_CPU_AFFINITY),
    F("-Cr --cpu-range", effect=NONE, why=_CPU_AFFINITY),
    F("--cpu-strict", effect=NONE, why=_CPU_AFFINITY),
    F("--prio", effect=NONE, why=_CPU_AFFINITY),
    F("--poll", effect=NONE, why=_CPU_AFFINITY),
    F("-Cb --cpu-mask-batch", effect=NONE, why=_CPU_AFFINITY),
    F("-Crb --cpu-range-batch", effect=NONE, why=_CPU_AFFINITY),
    F("--cpu-strict-batch", effect=NONE, why=_CPU_AFFINITY),
    F("--prio-batch", effect=NONE, why=_CPU_AFFINITY),
    F("--poll-batch", effect=NONE, why=_CPU_AFFINITY),
    F("--compile", "bool", False, source=KV,
      help="torch.compile the decode step in the background (serves eagerly until ready; ~90 s of CPU the "
           "first time, cached in $KVSERVE_HOME/inductor)"),
    F("--native-kernels", "bool", False, source=KV,
      help="with --compile on AVX512-VNNI CPUs: kvserve's own 4-bit kernel (llama.cpp's int8 activation "
           "rounding) in place of torch's int4 kernel for steps of up to 16 rows"),
    F("--enforce-eager", "bool", False, "no compiled or captured graphs", source=VLLM,
      why="turns --compile off"),
    F("-O --compilation-config", source=VLLM, effect=NONE, why="kvserve compiles only with --compile"),
    F("--max-seq-len-to-capture", "int", source=VLLM, effect=NONE, why="no CUDA graphs"),
    F("--cuda-graph-sizes", "list", source=VLLM, effect=NONE, why="no CUDA graphs"),
    F("--max-cudagraph-capture-size", "int", source=VLLM, effect=NONE, why="no CUDA graphs"),
    F("--model-impl", source=VLLM, effect=NONE, why="kvserve's own model code"),
    F("--disable-sliding-window", "bool", False, source=VLLM, effect=NONE,
      why="sliding-window layers (gemma2, gemma3, gpt-oss, phi3 with a window) keep the window the model "
          "defines; the context is not capped to it as vLLM does"),
    F("--disable-cascade-attn", "bool", False, source=VLLM, effect=NONE, why="no cascade attention"),
    F("--enable-sleep-mode", "bool", False, source=VLLM, effect=NONE,
      why="see --sleep-idle-seconds and --keep-alive"),
    F("--max-parallel-loading-workers", "int", source=VLLM, effect=NONE, why="one loader"),
    F("--rope-scaling", help="llama-server: none/linear/yarn; vLLM: JSON", source=BOTH,
      env="LLAMA_ARG_ROPE_SCALING_TYPE", effect=WARN, why=_ROPE),
    F("--rope-scale", "float", env="LLAMA_ARG_ROPE_SCALE", effect=WARN, why=_ROPE),
    F("--rope-freq-base", "float", env="LLAMA_ARG_ROPE_FREQ_BASE", effect=WARN, why=_ROPE),
    F("--rope-freq-scale", "float", env="LLAMA_ARG_ROPE_FREQ_SCALE", effect=WARN, why=_ROPE),
    F("--rope-theta", "float", source=VLLM, effect=WARN, why=_ROPE),
    F("--yarn-orig-ctx", "int", env="LLAMA_ARG_YARN_ORIG_CTX", effect=WARN, why=_ROPE),
    F("--yarn-ext-factor", "float", env="LLAMA_ARG_YARN_EXT_FACTOR", effect=WARN, why=_ROPE),
    F("--yarn-attn-factor", "float", env="LLAMA_ARG_YARN_ATTN_FACTOR", effect=WARN, why=_ROPE),
    F("--yarn-beta-slow", "float", env="LLAMA_ARG_YARN_BETA_SLOW", effect=WARN, why=_ROPE),
    F("--yarn-beta-fast", "float", env="LLAMA_ARG_YARN_BETA_FAST", effect=WARN, why=_ROPE),
    F("--warmup", "bool", True, neg="--no-warmup", effect=NONE, why="kvserve runs no warm-up pass"),
    F("--perf", "bool", False, neg="--no-perf", env="LLAMA_ARG_PERF", effect=NONE,
      why="timings are in every response"),
    F("-e --escape", "bool", True, neg="--no-escape", effect=NONE, why="prompts come from requests"),
    # -- parallelism (vLLM)
    F("-tp --tensor-parallel-size", "int", 1, "tensor-parallel ranks", source=VLLM,
      why="the model split over N processes on torch.distributed (heads, FFN rows, vocabulary; all-reduce "
          "per layer); docs/parallel.md", check=_parallel_check("tensor parallelism", "--tensor-parallel-size")),
    F("-pp --pipeline-parallel-size", "int", 1, "pipeline stages", source=VLLM,
      why="contiguous layer ranges in N processes, activations sent stage to stage, micro-batches in flight; "
          "docs/parallel.md",
      check=_parallel_check("pipeline parallelism", "--pipeline-parallel-size")),
    F("-dp --data-parallel-size", "int", 1, "data-parallel replicas", source=VLLM, effect=NONE,
      why="one process; replicas are N kvserve serve behind vllm-router (values above 1 are refused, "
          "naming the recipe)", check=_dp_check),
    F("-ep --enable-expert-parallel", "bool", False, source=VLLM, effect=NONE, why="one process"),
    F("--distributed-executor-backend", source=VLLM, effect=NONE, why="one process"),
    F("--disable-custom-all-reduce", "bool", False, source=VLLM, effect=NONE, why="one process"),
    F("--headless", "bool", False, source=VLLM, effect=REFUSE, why="kvserve always serves HTTP"),
    F("--api-server-count", "int", source=VLLM, effect=NONE, why="one HTTP server process"),
    # -- sampling defaults
    F("-n --predict --n-predict", "int", -1, "tokens to predict (-1 = until stop)", env="LLAMA_ARG_N_PREDICT"),
    F("--temp --temperature", "float", 0.8, "temperature", env="LLAMA_ARG_TEMPERATURE"),
    F("--top-k", "int", 40, "top-k (0 = off)", env="LLAMA_ARG_TOP_K"),
    F("--top-p", "float", 0.95, "top-p (1.0 = off)", env="LLAMA_ARG_TOP_P"),
    F("--min-p", "float", 0.05, "min-p (0.0 = off)", env="LLAMA_ARG_MIN_P"),
    F("--repeat-penalty", "float", 1.0, "repeat penalty (1.0 = off)", env="LLAMA_ARG_REPEAT_PENALTY"),
    F("--repeat-last-n", "int", help="tokens the penalties look back (default 64)", why="request default"),
    F("--presence-penalty", "float", help="presence penalty (default 0)", env="LLAMA_ARG_PRESENCE_PENALTY",
      why="request default"),
    F("--frequency-penalty", "float", help="frequency penalty (default 0)", env="LLAMA_ARG_FREQUENCY_PENALTY",
      why="request default"),
    F("--typical --typical-p", "float", help="locally typical p (default 1.0 = off)", why="request default"),
    F("--top-nsigma --top-n-sigma", "float", help="top-n-sigma (default -1 = off)", why="request default"),
    F("--xtc-probability", "float", help="XTC probability (default 0)", why="request default"),
    F("--xtc-threshold", "float", help="XTC threshold (default 0.1)", why="request default"),
    F("--dry-multiplier", "float", help="DRY multiplier (default 0 = off)", why="request default"),
    F("--dry-base", "float", help="DRY base (default 1.75)", why="request default"),
    F("--dry-allowed-length", "int", help="DRY allowed length (default 2)", why="request default"),
    F("--dry-penalty-last-n", "int", help="DRY look-back (default -1 = context)", why="request default"),
    F("--dry-sequence-breaker", "append", help="DRY sequence breaker (repeatable; none = no breakers)",
      why="request default"),
    F("--samplers", help="sampler order, ';'-separated", why="request default", check=_error_of(samplers)),
    F("--ignore-eos", "bool", False, "keep generating after end of text", why="request default"),
    F("-l --logit-bias", "append", help="TOKEN_ID(+/-)BIAS, e.g. 15043+1 (repeatable)", why="request default",
      check=_error_of(logit_bias)),
    F("-s --seed", "int", -1, "RNG seed (-1 = random)", source=BOTH, config=_seed),
    F("--sampling-seq --sampler-seq", effect=WARN, why="use --samplers with full names"),
    F("--mirostat", "int", effect=WARN, why="mirostat is not available: the sampler chain is used"),
    F("--mirostat-lr", "float", effect=WARN, why="mirostat is not available"),
    F("--mirostat-ent", "float", effect=WARN, why="mirostat is not available"),
    F("--dynatemp-range", "float", effect=WARN, why="dynamic temperature is not available"),
    F("--dynatemp-exp", "float", effect=WARN, why="dynamic temperature is not available"),
    F("--adaptive-target", "float", effect=WARN, why="adaptive-p is not available"),
    F("--adaptive-decay", "float", effect=WARN, why="adaptive-p is not available"),
    F("--grammar", effect=WARN, why="a server-wide grammar is not applied: send grammar or json_schema per request"),
    F("--grammar-file", effect=WARN,
      why="a server-wide grammar is not applied: send grammar or json_schema per request"),
    F("-j --json-schema", effect=WARN, why="a server-wide schema is not applied: send json_schema per request"),
    F("-jf --json-schema-file", effect=WARN, why="a server-wide schema is not applied: send json_schema per request"),
    F("-bs --backend-sampling", "bool", False, env="LLAMA_ARG_BACKEND_SAMPLING", effect=NONE,
      why="sampling runs beside the model"),
    F("-r --reverse-prompt", effect=NONE, why="interactive mode only"),
    F("-sp --special", "bool", False, "show special tokens in output", effect=WARN,
      why="special tokens are not shown as text in responses"),
    F("--override-generation-config", help="JSON sampling defaults (temperature, top_p, top_k, min_p, "
      "repetition_penalty, presence_penalty, frequency_penalty, max_new_tokens)", source=VLLM, convert=json_object,
      why="the keys become every model's sampling defaults, over its generation_config.json and the sampling "
      "flags (a request's own fields win)", check=_error_of(generation_overrides),
      config=lambda cfg: dict(cfg or {})),
    F("--generation-config", default="auto", help="auto (the model's generation_config.json, or a GGUF's "
      "general.sampling.* keys), vllm (no file; vLLM's neutral sampling values) or a directory holding a "
      "generation_config.json", source=VLLM,
      check=lambda v: _generation_config_check(v),
      why="the model's sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; "
      "a GGUF's general.sampling.*) apply to requests that leave them out; a sampling flag given wins over them"),
    F("--max-logprobs", "int", 20, "most logprobs per token a request may ask for (-1: vocabulary size)",
      source=VLLM, check=_at_least("--max-logprobs", -1, "-1 (vocabulary size) or >= 0")),
    F("--logprobs-mode", source=VLLM, effect=NONE, why="logprobs are of the processed distribution"),
    # -- chat templates, tools, reasoning
    F("--jinja", "bool", True, "use the Jinja chat template", neg="--no-jinja", env="LLAMA_ARG_JINJA"),
    F("--chat-template", help="a file (vLLM), a built-in name (chatml, llama3, ...) or Jinja text", source=BOTH,
      env="LLAMA_ARG_CHAT_TEMPLATE", metavar="TEMPLATE",
      why="a file's path, one of llama-server's built-in names, or inline Jinja (contains {{ or {%)",
      check=_chat_template_check),
    F("--chat-template-file", help="file with a Jinja chat template", env="LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    F("--chat-template-content-format", default="auto", help="message content as string or openai parts",
      source=VLLM, choices=("auto", "string", "openai"),
      why="string: content is a string; openai: a list of {type: text} parts; auto: a string"),
    F("--chat-template-kwargs", help="JSON object passed to every chat template render", source=LLAMA,
      env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS", convert=json_object),
    F("--default-chat-template-kwargs", help="JSON object of template variables; a request's own win",
      source=VLLM, convert=json_object, why="merged with --chat-template-kwargs (this one first)"),
    F("--trust-request-chat-template", "bool", False, source=VLLM,
      help="render a chat request with its own chat_template (without it such a request gets vLLM's 400)"),
    F("--tool-call-parser", help="tool-call parser, a vLLM name: deepseek_v3, deepseek_v31, glm45, glm47, granite, "
      "granite4, hermes, kimi_k2, llama3_json, llama4_json, llama4_pythonic, longcat, mimo, minimax_m2, mistral, "
      "openai, phi4_mini_json, pythonic, qwen3_coder, qwen3_xml, seed_oss (other vLLM names: start-up error)",
      source=VLLM, check=_tool_parser_check),
    F("--enable-auto-tool-choice", "bool", False, 'allow tool_choice "auto"', source=VLLM),
    F("--exclude-tools-when-tool-choice-none", "bool", False,
      'leave tool definitions out of the prompt when tool_choice is "none"', source=VLLM),
    F("--tool-parser-plugin", source=VLLM, effect=REFUSE, why="kvserve loads no parser plugins"),
    F("--tool-server", source=VLLM, effect=WARN, why="no built-in tool servers"),
    F("--reasoning-format", default="auto", choices=("auto", "none", "deepseek", "deepseek-legacy"),
      help="where thinking goes in chat responses: reasoning_content unless none", env="LLAMA_ARG_THINK"),
    F("--reasoning-parser", help="split thinking into the 'reasoning' field, a vLLM name: deepseek_r1, "
      "deepseek_v3, glm45, granite, kimi_k2, minimax_m2, minimax_m2_append_think, mistral, openai_gptoss, qwen3, "
      "seed_oss, step3 (other vLLM names: start-up error)",
      source=VLLM, check=_reasoning_parser_check),
    F("--reasoning-budget", "int", -1, "thinking tokens before </think> is forced (-1: no limit)",
      env="LLAMA_ARG_THINK_BUDGET", check=_at_least("--reasoning-budget", -1, "-1 (no limit) or >= 0")),
    F("-rea --reasoning", "opt", None, "enable_thinking for every request's template (on, off, auto)",
      const="on", choices=("on", "off", "auto"), env="LLAMA_ARG_REASONING"),
    F("--reasoning-effort", env="LLAMA_ARG_REASONING_EFFORT", effect=WARN,
      why="send reasoning_effort per request"),
    F("--reasoning-budget-message", env="LLAMA_ARG_THINK_BUDGET_MESSAGE", effect=WARN,
      why="no message is injected when the budget ends"),
    F("--reasoning-preserve", "bool", True, neg="--no-reasoning-preserve", env="LLAMA_ARG_REASONING_PRESERVE",
      effect=NONE, why="the template decides which reasoning it renders"),
    F("--skip-chat-parsing", "bool", False, neg="--no-skip-chat-parsing", env="LLAMA_ARG_SKIP_CHAT_PARSING",
      effect=WARN, why="tool calls and reasoning are still parsed"),
    F("--prefill-assistant", "bool", True, neg="--no-prefill-assistant", env="LLAMA_ARG_PREFILL_ASSISTANT",
      effect=NONE, why="a final assistant message is continued", neg_effect=WARN,
      neg_why="a final assistant message is still continued"),
    F("--response-role", default="assistant", help="role of chat completion answers", source=VLLM,
      why="message.role and the first stream delta's role when add_generation_prompt (vLLM's); else the last "
          "message's role; an empty role is refused at start-up (exit 2)",
      check=lambda r: None if str(r).strip() else
      "--response-role: the role must not be empty (e.g. --response-role assistant)"),
    F("--tools", "str", None, "built-in server tools (file and shell access) served at /tools: TOOL1,TOOL2,... or all",
      env="LLAMA_ARG_TOOLS", metavar="TOOL1,TOOL2,...", convert=string_list, check=_tools_check,
      why="GET/POST /tools (kvserve.tools); CORS limited to localhost unless --cors-origins; routes behind --api-key "
          "and the local-origin/Host rules of /api"),
    F("--tools-runtime", help="run every tool call in a running container: docker-container:ID, podman-container:ID",
      env="LLAMA_ARG_TOOLS_RUNTIME", check=_tools_runtime_check,
      why="only an existing container (docker:IMAGE and ssh: are refused at start-up)"),
    F("--tools-confine", "bool", False, "keep absolute tool paths inside the caller's x-tool-cwd too", source=KV,
      neg="--no-tools-confine", env="KVSERVE_TOOLS_CONFINE",
      why="relative paths always stay inside the cwd; llama-server (and its tests) let absolute paths go anywhere"),
    F("--mcp-servers-config", help="JSON file of MCP servers ({\"mcpServers\": ...}) whose tools /tools offers",
      env="LLAMA_ARG_MCP_SERVERS_CONFIG", metavar="FILE",
      why="stdio (command/args/env) and streamable-HTTP (url/headers) servers, started at warm-up; their tools are "
          "listed and run by /tools as <server>_<tool>; a file that cannot be read or parsed refuses start-up"),
    F("--mcp-servers-json", help="the same MCP servers JSON inline", env="LLAMA_ARG_MCP_SERVERS_JSON", metavar="JSON",
      why="as --mcp-servers-config (both may be given: the file's servers first); invalid JSON refuses start-up"),
    F("-ag --agent", "bool", False, neg="-no-ag --no-agent", env="LLAMA_ARG_AGENT", effect=WARN,
      why="kvserve has no built-in server tools"),
    # -- features kvserve does not have
    F("--lora", "append", help="LoRA adapter: a llama.cpp LoRA GGUF or a PEFT directory (comma-separated or "
      "repeated for several; ids in command-line order with --lora-scaled's)", metavar="FNAME", config=lora_paths),
    F("--lora-scaled", "append", help="LoRA adapter with its scale, FNAME:SCALE,... (or FNAME SCALE); ids in "
      "command-line order with --lora's", metavar="FNAME:SCALE", check=_lora_scaled_check, config=lora_scaled),
    F("--lora-init-without-apply", "bool", False, help="load LoRA adapters with scale 0 (apply later via POST "
      "/lora-adapters)"),
    F("--lora-modules", "list", source=VLLM, metavar="NAME=PATH|JSON",
      help="LoRA adapters served as model names: name=path or JSON {\"name\", \"path\", \"base_model_name\"}",
      why="each adapter is a model name in /v1/models (parent: its base) chosen by `model` in any face's request; "
          "checked against its base at start-up (implies --enable-lora)"),
    F("--enable-lora", "bool", False, source=VLLM, help="serve LoRA adapters (--lora-modules, /v1/load_lora_adapter)",
      why="adapters are weights beside the base, never merged; --max-loras then defaults to 1 and --max-lora-rank to "
          "16 (vLLM's); /v1/load_lora_adapter also needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"),
    F("--max-loras", "int", help="most distinct LoRA adapters in one engine step (default: 1 with --enable-lora, "
      "as vLLM; else no limit, as llama-server)", source=VLLM, check=_at_least("--max-loras", 1, ">= 1"),
      why="rows of more adapters wait for a later step (vLLM's queueing); a request naming more is refused"),
    F("--max-lora-rank", "int", help="largest LoRA rank accepted (default: 16 with --enable-lora, as vLLM; else any)",
      source=VLLM, check=_lora_rank_check, why="an adapter of a larger rank is refused when it loads"),
    F("--lora-dtype", default="auto", source=VLLM, choices=("auto", "float16", "bfloat16", "float32"),
      help="dtype of the LoRA adapters' A and B (auto: the model's dtype; float32 on the CPU)",
      why="the adapters' A and B are stored in it (float16/bfloat16: half of float32's memory and of the native "
          "decode step's LoRA reads) and read as float32: the delta's arithmetic stays float32 (vLLM computes it "
          "in the narrow type)"),
    F("--max-cpu-loras", "int", source=VLLM, help="LoRA adapters kept in memory per model (LRU; default --max-loras)",
      check=_at_least("--max-cpu-loras", 1, ">= 1"),
      why="a request for an adapter not in memory loads it, evicting the least recently used idle one"),
    F("--control-vector", effect=REFUSE, why="control vectors are not available: the model would answer unsteered"),
    F("--control-vector-scaled", effect=REFUSE, why="control vectors are not available"),
    F("--control-vector-layer-range", "list", effect=REFUSE, why="control vectors are not available"),
    F("-md --model-draft --spec-draft-model", help="draft model for speculative decoding (.gguf path, HF directory "
      "or store name)", env="LLAMA_ARG_SPEC_DRAFT_MODEL LLAMA_ARG_MODEL_DRAFT", metavar="FNAME",
      why="the draft runs beside the target on the target's KV block ids and drafts up to --draft-max tokens "
      "per sequence and step, verified by the target (greedy: token-identical; sampling: the rejection rule); "
      "its vocabulary must be the target's (else the server does not start)"),
    F("-hfd -hfrd --hf-repo-draft --spec-draft-hf", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO", effect=WARN, why=_DRAFT),
    F("--spec-type", help="speculative decoding: ngram (prompt lookup; llama-server's ngram-simple) or none",
      env="LLAMA_ARG_SPEC_TYPE", check=_spec_type_check, metavar="TYPE",
      why="ngram: the last n-gram of the sequence is looked up in its prompt and output and the tokens that "
      "followed are verified in one step (greedy requests; output token-identical)"),
    F("--spec-default", "bool", False, effect=WARN, why="kvserve has no default speculative settings: use "
      "--spec-type ngram"),
    F("--speculative-config", help="vLLM's speculative config (JSON): method ngram, num_speculative_tokens, "
      "prompt_lookup_max, prompt_lookup_min", source=VLLM, convert=json_object, check=_spec_config_check,
      metavar="JSON", why="method ngram (prompt_lookup_max/min) or a draft model (\"model\", method draft_model); "
      "EAGLE, MTP and other methods are refused"),
    F("--spec-ngram-size-n", "int", help="ngram: length of the looked-up n-gram (tokens)", metavar="N",
      why="sets prompt_lookup_max and prompt_lookup_min to N", check=lambda n: _positive("--spec-ngram-size-n")(n) or _at_most_lookup(n)),
    F("--spec-ngram-size-m", "int", help="ngram: most draft tokens per step when --draft-max is not given",
      metavar="M", why="as --draft-max",
      check=lambda n: _positive("--spec-ngram-size-m")(n) or _draft_max_check(n, "--spec-ngram-size-m")),
    F("-ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-ngl", env="LLAMA_ARG_N_GPU_LAYERS_DRAFT",
      effect=NONE, why="the draft runs on the target's device"),
    F("-td --threads-draft --spec-draft-threads", "int", effect=NONE, why="the draft uses the target's threads"),
    F("-tbd --threads-batch-draft --spec-draft-threads-batch", "int", effect=NONE,
      why="the draft uses the target's threads"),
    F("-devd --device-draft --spec-draft-device", effect=NONE, why="the draft runs on the target's device"),
    F("-cd --ctx-size-draft", "int", effect=NONE,
      why="the draft's KV pool has the target's blocks (the same block ids), so its context is the target's"),
    F("-ctkd --cache-type-k-draft --spec-draft-type-k", effect=NONE, why="the draft's KV cache has the target's types"),
    F("-ctvd --cache-type-v-draft --spec-draft-type-v", effect=NONE, why="the draft's KV cache has the target's types"),
    F("--draft --draft-n --draft-max --spec-draft-n-max", "int", help="most draft tokens per step (default 16)",
      env="LLAMA_ARG_DRAFT_MAX", why="with --spec-type ngram or -md: most tokens proposed per sequence and step",
      check=_draft_max_check),
    F("--draft-min --draft-n-min --spec-draft-n-min", "int", help="shorter drafts are dropped (default 0)",
      env="LLAMA_ARG_DRAFT_MIN", why="with --spec-type ngram or -md: drafts shorter than this are not verified",
      check=_non_negative("--draft-min")),
    F("--draft-p-min --spec-draft-p-min", "float", help="minimum speculative decoding probability (greedy) "
      "(default 0.00)", env="LLAMA_ARG_SPEC_DRAFT_P_MIN", metavar="P",
      why="with -md: a sequence stops drafting when the draft's top token is less likely than P (that token is "
      "not drafted)", check=lambda p: None if 0.0 <= p <= 1.0 else f"--draft-p-min must be in [0, 1], got {p}"),
    F("--draft-p-split --spec-draft-p-split", "float", effect=NONE, why="kvserve drafts one sequence of tokens per request (no split into a tree of drafts)"),
    F("-lcs --lookup-cache-static", effect=NONE, why="no lookup decoding"),
    F("-lcd --lookup-cache-dynamic", effect=NONE, why="no lookup decoding"),
    F("-mm --mmproj", env="LLAMA_ARG_MMPROJ", effect=WARN, why=_NO_MM),
    F("-mmu --mmproj-url", env="LLAMA_ARG_MMPROJ_URL", effect=WARN, why=_NO_MM),
    F("--mmproj-auto", "bool", True, neg="--no-mmproj --no-mmproj-auto", env="LLAMA_ARG_MMPROJ_AUTO", effect=NONE,
      why="text only"),
    F("--mmproj-offload", "bool", True, neg="--no-mmproj-offload", env="LLAMA_ARG_MMPROJ_OFFLOAD", effect=NONE,
      why="text only"),
    F("--image-min-tokens", "int", effect=NONE, why="text only"),
    F("--image-max-tokens", "int", effect=NONE, why="text only"),
    F("--limit-mm-per-prompt", source=VLLM, effect=NONE, why="text only"),
    F("--mm-processor-kwargs", source=VLLM, effect=NONE, why="text only"),
    F("--media-path", effect=NONE, why="text only"),
    F("--enable-prompt-embeds", "bool", False, source=VLLM, effect=WARN,
      why="prompt embeddings in requests are not accepted"),
    F("--skip-tokenizer-init", "bool", False, source=VLLM, effect=REFUSE,
      why="kvserve needs the tokenizer: requests and responses carry text"),
    F("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
      "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default "
      "--vision-gemma-4b-default --vision-gemma-12b-default", "bool", False, dest="preset_model", effect=REFUSE,
      why="preset models download from Hugging Face: kvserve pull NAME, then -m NAME"),
    F("-cl --cache-list", "bool", False, effect=REFUSE, why="list the store with kvserve list"),
    F("--completion-bash", "bool", False, effect=REFUSE, why="no bash completion script"),
    # -- embeddings
    F("--embedding --embeddings", "bool", False, "serve a generative model as an embedding model",
      env="LLAMA_ARG_EMBEDDINGS"),
    F("--rerank --reranking", "bool", False, env="LLAMA_ARG_RERANKING", effect=NONE,
      why="/rerank is always on; it needs a cross-encoder or an embedding model"),
    F("--pooling", help="pooled embedding of an input: none (a vector per token), mean, cls, last; rank: the "
      "model's own (a reranker)", env="LLAMA_ARG_POOLING", choices=("none", "mean", "cls", "last", "rank"),
      config=lambda p: None if p == "rank" else p),
    F("--embd-normalize", "int", effect=WARN, why="send embd_normalize per request"),
    F("--task", source=VLLM, why="embed/embedding: as --embeddings; generate/auto: nothing to do",
      check=lambda v: None if v in ("auto", "generate", "embed", "embedding") else
      f"--task {v}: kvserve serves generate and embed models (encoders are detected from their config)"),
    F("--runner", source=VLLM, why="pooling: as --embeddings; generate/auto: nothing to do",
      check=lambda v: None if v in ("auto", "generate", "pooling") else
      f"--runner {v}: kvserve runs generate and pooling models"),
    F("--convert", source=VLLM, why="embed: as --embeddings; auto/none: nothing to do",
      check=lambda v: None if v in ("auto", "none", "embed") else
      f"--convert {v}: kvserve converts generative models to embed only (--embeddings)"),
    F("--pooler-config --override-pooler-config", source=VLLM, effect=WARN, why="the model's own pooling is used"),
    # -- HTTP server
    F("--host", "append", "127.0.0.1", help="address(es) to listen on: comma-separated or repeated", source=BOTH,
      env="LLAMA_ARG_HOST", why="every address gets a socket on --port (llama-server #28690: comma list or "
                                "repeated, all must bind; each listening URL logged); the first one guards /api",
      check=_host_check),
    F("--port", "int", 8080, "port to listen on", source=BOTH, env="LLAMA_ARG_PORT", check=_port_check),
    F("--uds", source=VLLM, effect=REFUSE, why="kvserve listens on TCP (--host, --port)"),
    F("--reuse-port", "bool", False, env="LLAMA_ARG_REUSE_PORT", effect=NONE, why="one listening socket"),
    F("--path", help="directory of static files served at /", env="LLAMA_ARG_STATIC_PATH",
      why="the web UI serves its files from it"),
    F("--api-prefix", help="path prefix the server serves from", env="LLAMA_ARG_API_PREFIX",
      why="routes answer under the prefix and without it; every guard reads the path below it", config=_api_prefix),
    F("--root-path", help="path prefix behind a proxy", source=VLLM, why="uvicorn's root_path",
      config=lambda p: (p or "").rstrip("/")),
    F("--webui --ui", "bool", True, "serve the web chat page at / to browsers", neg="--no-webui --no-ui",
      env="LLAMA_ARG_UI LLAMA_ARG_WEBUI"),
    F("--ui-config --webui-config", env="LLAMA_ARG_UI_CONFIG", effect=NONE, why="the page's settings are its own"),
    F("--ui-config-file --webui-config-file", env="LLAMA_ARG_UI_CONFIG_FILE", effect=NONE,
      why="the page's settings are its own"),
    F("--ui-mcp-proxy --webui-mcp-proxy", "bool", False, neg="--no-ui-mcp-proxy --no-webui-mcp-proxy",
      env="LLAMA_ARG_UI_MCP_PROXY", help="serve llama-server's /cors-proxy (forwards only the headers named "
      "x-llama-server-proxy-header-*)"),
    F("--api-key", "append", help="API key(s), comma-separated or repeated", source=BOTH,
      env="LLAMA_API_KEY VLLM_API_KEY"),
    F("--api-key-file", help="file with one API key per line", env="LLAMA_ARG_API_KEY_FILE",
      check=_api_key_file_check),
    F("--ssl-key-file --ssl-keyfile", help="PEM private key (TLS)", source=BOTH, env="LLAMA_ARG_SSL_KEY_FILE",
      why="uvicorn serves HTTPS with it (needs --ssl-cert-file)", check=_existing_file("--ssl-key-file")),
    F("--ssl-cert-file --ssl-certfile", help="PEM certificate (TLS)", source=BOTH, env="LLAMA_ARG_SSL_CERT_FILE",
      why="uvicorn serves HTTPS with it (needs --ssl-key-file)", check=_existing_file("--ssl-cert-file")),
    F("--ssl-ca-certs", help="CA certificates file", source=VLLM, why="uvicorn's ssl_ca_certs",
      check=_existing_file("--ssl-ca-certs")),
    F("--ssl-cert-reqs", "int", 0, "client certificate: 0 none, 1 optional, 2 required", source=VLLM,
      why="uvicorn's ssl_cert_reqs"),
    F("--ssl-ciphers", source=VLLM, why="uvicorn's ssl_ciphers"),
    F("--enable-ssl-refresh", "bool", False, source=VLLM, effect=NONE, why="restart to load new certificates"),
    F("--cors-origins", default="*", help="comma-separated allowed origins, * for all, localhost for local pages",
      env="LLAMA_ARG_CORS_ORIGINS",
      why="an allowed Origin is reflected (Vary: Origin); localhost allows http(s)://localhost, 127.0.0.1, [::1] "
          "at any port; with --tools the default is localhost, as llama-server; '' allows no origin (no CORS headers); "
          "Vary: Origin on every answer unless plain * without credentials"),
    F("--allowed-origins", help='allowed origins: JSON list (["*"]) or comma-separated', source=VLLM,
      convert=string_list, why="as --cors-origins (which wins when both are given)"),
    F("--cors-methods", default="GET, POST, DELETE, OPTIONS", help="Access-Control-Allow-Methods of a preflight",
      env="LLAMA_ARG_CORS_METHODS", why="sent as given on preflight answers"),
    F("--cors-headers", default="*", help="Access-Control-Allow-Headers of a preflight", env="LLAMA_ARG_CORS_HEADERS",
      why="sent as given on preflight answers"),
    F("--cors-credentials", "bool", True, "send Access-Control-Allow-Credentials: true", neg="--no-cors-credentials",
      env="LLAMA_ARG_CORS_CREDENTIALS", why="with origins *, credentials reflect the Origin instead of *"),
    F("--allow-credentials", "bool", False, source=VLLM, why="as --cors-credentials (on by default, llama-server's)"),
    F("--allowed-methods", source=VLLM, convert=string_list, why="as --cors-methods (JSON list or comma-separated)"),
    F("--allowed-headers", source=VLLM, convert=string_list, why="as --cors-headers (JSON list or comma-separated)"),
    F("-to --timeout --timeout-keep-alive", "float", help="seconds an idle keep-alive connection stays open",
      env="LLAMA_ARG_TIMEOUT VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
      why="uvicorn's keep-alive timeout (--timeout-keep-alive is uvicorn's name; uvicorn has no read/write "
      "timeout: see --header-timeout)",
      check=lambda n: f"invalid --timeout {n}: seconds, > 0" if n <= 0 else None),
    F("--threads-http", "int", env="LLAMA_ARG_THREADS_HTTP", effect=NONE,
      why="HTTP requests are served by one asyncio event loop"),
    F("--sse-ping-interval", "float", 30.0, "seconds between SSE comment pings", env="LLAMA_ARG_SSE_PING_INTERVAL"),
    F("--max-request-bytes", "int", 32 * 1024 * 1024, "largest request body in bytes (413 above it)", source=KV,
      env="KVSERVE_MAX_REQUEST_BYTES", check=_at_least("--max-request-bytes", 1, "at least 1")),
    F("--max-batch-inputs", "int", 2048, "most embedding inputs, rerank documents, score pairs or completion "
      "prompts in one request (400 above)", source=KV, env="KVSERVE_MAX_BATCH_INPUTS",
      check=_at_least("--max-batch-inputs", 1, "at least 1")),
    F("--max-input-bytes", "int", 2 << 20, "most text bytes one embedding, rerank, score or /tokenize request "
      "may send (400 above; generation routes check prompts against the context)", source=KV,
      env="KVSERVE_MAX_INPUT_BYTES", convert=human_int, metavar="BYTES",
      check=_at_least("--max-input-bytes", 1, "at least 1")),
    F("--header-timeout", "float", 30.0, "seconds a connection has to send a whole request head, after it opens "
      "and after each response (then it is closed)", source=KV, env="KVSERVE_HEADER_TIMEOUT",
      check=lambda n: None if n > 0 else f"--header-timeout must be > 0, got {n}"),
    F("--limit-concurrency", "int", 4096, "open connections at most: a newer one is closed at once (uvicorn's name; "
      "uvicorn answers it 503 in plain text)", source=KV, env="KVSERVE_LIMIT_CONCURRENCY",
      check=_positive("--limit-concurrency")),
    F("--shutdown-timeout", "float", 5.0, "seconds requests in flight may go on after SIGTERM; then each ends "
      "with a 503 or a last error event", source=KV, env="KVSERVE_SHUTDOWN_TIMEOUT", config=lambda s: max(s, 0.0)),
    F("--pull-max-blob-size", "int", 0, "largest blob a pulled manifest may declare, bytes or 10G (0: no cap but "
      "free disk space, which every pull checks)", source=KV, env="KVSERVE_PULL_MAX_BLOB_SIZE", convert=human_int,
      metavar="BYTES", config=lambda n: max(n, 0)),
    F("--pull-timeout", "float", 12 * 3600.0, "seconds one /api/pull may take in all (0: no limit)", source=KV,
      env="KVSERVE_PULL_TIMEOUT", config=lambda s: max(s, 0.0)),
    F("--middleware", "append", source=VLLM, effect=REFUSE, why="kvserve imports no middleware"),
    F("--enable-request-id-headers", "bool", False, source=VLLM, effect=NONE, why="no X-Request-Id header"),
    F("--disable-fastapi-docs", "bool", False, source=VLLM, effect=NONE, why="kvserve serves no API docs"),
    F("--disable-uvicorn-access-log", "bool", False, source=VLLM, effect=NONE, why="the access log is off"),
    F("--uvicorn-log-level", source=VLLM, choices=("critical", "error", "warning", "info", "debug", "trace"),
      help="uvicorn's log level (default warning)", why="uvicorn's log level"),
    F("--h11-max-incomplete-event-size", "int", source=VLLM, effect=NONE,
      why="bodies are bounded by --max-request-bytes"),
    F("--h11-max-header-count", "int", source=VLLM, effect=NONE, why="uvicorn's own limits apply"),
    # -- endpoints and responses
    F("--metrics", "bool", False, "enable /metrics", env="LLAMA_ARG_ENDPOINT_METRICS"),
    F("--props", "bool", False, "enable POST /props", env="LLAMA_ARG_ENDPOINT_PROPS"),
    F("--slots", "bool", True, "GET /slots (given: with requests' text)", neg="--no-slots",
      env="LLAMA_ARG_ENDPOINT_SLOTS", config=bool),
    F("--slot-save-path", help="existing directory for slot files", env="LLAMA_ARG_SLOT_SAVE_PATH",
      check=_slot_save_path_check),
    F("--tags", help="model tags, comma-separated (informational)", env="LLAMA_ARG_TAGS",
      why="/v1/models data[].tags: sorted, each once (llama-server's)",
      config=lambda t: [x.strip() for x in (t or "").split(",") if x.strip()]),
    F("--return-tokens-as-token-ids", "bool", False, "logprobs tokens as token_id:N", source=VLLM,
      why="OpenAI logprobs tokens (and top_logprobs) read token_id:N, their bytes those of the token's text"),
    F("--enable-prompt-tokens-details", "bool", False, source=VLLM, effect=NONE,
      why="usage.prompt_tokens_details is always included"),
    F("--enable-force-include-usage", "bool", False, "every OpenAI stream ends with a usage chunk", source=VLLM,
      why="as stream_options.include_usage on every stream (continuous_usage_stats still per request)"),
    F("--enable-tokenizer-info-endpoint", "bool", False, source=VLLM, effect=NONE, why="no /tokenizer_info"),
    F("--enable-server-load-tracking", "bool", False, source=VLLM, effect=NONE, why="no load tracking"),
    F("--spm-infill", "bool", False, effect=NONE, why="infill uses the model's FIM tokens in their own order"),
    # -- logging
    F("-v --verbose --log-verbose", "bool", False, "log everything (debug lines, requests and responses)",
      why="as -lv 5: debug lines and, per request, llama-server's done request/request/response lines (bodies "
          "cut at 2048 bytes, API keys written ***)"),
    F("-lv --log-verbosity --verbosity", "int", 3, "log verbosity (>= 4: debug lines)",
      env="LLAMA_ARG_LOG_VERBOSITY"),
    F("--log-disable", "bool", False, "no log output"),
    F("--log-file", help="also log to this file", env="LLAMA_ARG_LOG_FILE"),
    F("--log-colors", "opt", const="on", choices=("on", "off", "auto"), env="LLAMA_ARG_LOG_COLORS", effect=NONE,
      why=_LOG_SHAPE),
    F("--log-prefix", "bool", True, neg="--no-log-prefix", env="LLAMA_ARG_LOG_PREFIX", effect=NONE, why=_LOG_SHAPE),
    F("--log-timestamps", "bool", True, neg="--no-log-timestamps", env="LLAMA_ARG_LOG_TIMESTAMPS", effect=NONE,
      why=_LOG_SHAPE),
    F("--log-jsonl", "bool", False, neg="--no-log-jsonl", env="LLAMA_ARG_LOG_JSONL", effect=NONE, why=_LOG_SHAPE),
    F("--log-prompts-dir", effect=WARN, why="prompts are not logged to files"),
    F("--disable-log-stats", "bool", False, "no periodic 'Engine 000: Avg prompt throughput ...' stats log line "
      "(written every VLLM_LOG_STATS_INTERVAL s, default 10, while a model is busy)", source=VLLM),
    F("--disable-log-requests", "bool", False, source=VLLM, effect=NONE, why="requests are not logged by default"),
    F("--enable-log-requests", "bool", False, source=VLLM, effect=NONE, why="request logging is -v"),
    F("--enable-log-outputs", "bool", False, source=VLLM, effect=NONE, why="request logging is -v"),
    F("--max-log-len", "int", source=VLLM, effect=NONE, why="prompts are not logged"),
    F("--log-config-file", source=VLLM, effect=NONE, why=_LOG_SHAPE),
    F("--log-error-stack", "bool", False, source=VLLM, effect=NONE, why="unhandled errors log their traceback"),
    # -- model manager (Ollama) and lifetime
    F("--keep-alive", default="5m", help="how long an idle model stays loaded: seconds or a duration (5m, 1h30m); "
      "negative = forever, 0 = unload after each request", source=OLLAMA, env="KVSERVE_KEEP_ALIVE OLLAMA_KEEP_ALIVE",
      check=_error_of(keep_alive_seconds), config=keep_alive_seconds),
    F("--sleep-idle-seconds", "float", -1.0, "unload the -m model after this many idle seconds (-1: never); it "
      "loads again on the next request", why="the -m model is unloaded when idle and reloaded on demand",
      check=lambda n: f"invalid --sleep-idle-seconds {n}: -1 (never) or >= 0" if n < 0 and n != -1 else None),
    F("--max-loaded-models", "int", 0, "most models loaded at once (0 = default 3)", source=OLLAMA,
      env="OLLAMA_MAX_LOADED_MODELS", check=_at_least("--max-loaded-models", 0, "0 (default 3) or more")),
    F("--max-memory", help="cap on the memory of all loaded models together (MiB, or 8GiB)", source=KV,
      env="KVSERVE_MAX_MEMORY", check=lambda t: _error_of(parse_memory)(t) if t else None,
      config=lambda t: parse_memory(t) if t else None),
    F("--max-queue", "int", 512, "most requests waiting for a model at once (503 above)", source=OLLAMA,
      env="OLLAMA_MAX_QUEUE", check=_at_least("--max-queue", 1, "at least 1")),
    F("--preload", "bool", True, neg="--no-preload", source=KV,
      help="load the start-up model at once (--no-preload: on its first request)"),
    F("--allow-model-paths", "bool", False, "requests may name .gguf files or HF directories on the server",
      source=KV),
    F("--remote", "append", help="serve a model another server runs (repeatable): "
      "name=URL[,key=ENV_VAR][,model=UPSTREAM_NAME][,dialect=openai|ollama]", source=KV,
      metavar="NAME=URL[,...]", check=_named_models_check("--remote"), config=_named_models_config("--remote")),
    F("--engine", "append", help="serve a model through an engine kvserve starts and supervises (repeatable): "
      "NAME=COMMAND, the command holding {port} (e.g. 'smol=llama-server -m x.gguf --port {port}')", source=KV,
      metavar="NAME=COMMAND", check=_named_models_check("--engine"), config=_named_models_config("--engine")),
    F("--engine-start-timeout", "float", 600.0, "seconds a supervised engine may take to answer 200 on /health",
      source=KV, metavar="SECONDS",
      check=lambda v: None if v > 0 else f"--engine-start-timeout must be positive, got {v:g}"),
    F("--version", "bool", False, "print the version and exit", source=BOTH),
)

#: llama-server and vLLM take ``-h``/``--help``; llama-server also ``--usage``
HELP_NAMES = ("-h", "--help", "--usage")
#: environment variables whose bad value is ignored (as before: Ollama's own parsing is lenient)
LENIENT_ENV = frozenset({"OLLAMA_MAX_LOADED_MODELS", "OLLAMA_MAX_QUEUE"})

BY_DEST: dict[str, Flag] = {}
BY_NAME: dict[str, Flag] = {}
for _flag in FLAGS:
    if _flag.dest in BY_DEST:
        raise RuntimeError(f"flag table: dest {_flag.dest} twice")
    BY_DEST[_flag.dest] = _flag
    for _n in _flag.names + _flag.neg:
        if _n in BY_NAME or _n in HELP_NAMES:
            raise RuntimeError(f"flag table: {_n} twice")
        BY_NAME[_n] = _flag


# -- the parser -----------------------------------------------------------------------------

class _Given(argparse.Action):
    """Stores a flag's value and records the spelling that gave it (``namespace._given``)."""

    def __init__(self, option_strings, dest, flag: Flag, negative: bool = False, **kw):
        self.flag, self.negative = flag, negative
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        f = self.flag
        if f.kind == "bool":
            value = not self.negative
        elif f.kind == "append":
            value = list(getattr(namespace, self.dest, None) or []) + [values]
            # every repeatable flag's words in command-line order (llama-server numbers --lora and
            # --lora-scaled adapters together, in the order given)
            namespace._appended = list(getattr(namespace, "_appended", [])) + [(self.dest, values)]
        else:
            value = values
            if f.convert is not None and isinstance(values, str):
                try:
                    value = f.convert(values)
                except ValueError as e:
                    raise argparse.ArgumentError(self, f"invalid value {values!r}: {e}") from None
        setattr(namespace, self.dest, value)
        given = dict(getattr(namespace, "_given", {}))
        given[self.dest] = option_string
        namespace._given = given


class FlagParser(argparse.ArgumentParser):
    """argparse without single-dash clustering and prefix matching: ``-ngl`` is one flag, an
    unknown ``-xyz`` an error, never ``-x yz``. Errors print usage and exit 2."""

    def _get_option_tuples(self, option_string):
        return []

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")

    def format_help(self) -> str:
        return help_text()


def build_parser() -> FlagParser:
    """The argparse parser of every flag in :data:`FLAGS`. A flag not given is absent from the
    namespace (``argument_default=SUPPRESS``); ``namespace._given`` maps each given dest to the
    spelling used."""
    p = FlagParser(prog="kvserve serve", allow_abbrev=False, add_help=False, argument_default=argparse.SUPPRESS,
                   description="Serve a model over HTTP (llama-server, vLLM, OpenAI and Ollama APIs).")
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="model name, .gguf path or HF dir (vLLM's positional MODEL)")
    p.add_argument(*HELP_NAMES, dest="help", action="store_true", default=False)
    types = {"int": int, "float": float}
    for f in FLAGS:
        kw: dict[str, Any] = {"flag": f, "dest": f.dest}
        if f.kind == "bool":
            kw["nargs"] = 0
        elif f.kind == "opt":
            kw.update(nargs="?", const=f.const)
        elif f.kind == "list":
            kw["nargs"] = "+"
        if f.kind in types and f.convert is None:
            kw["type"] = types[f.kind]
        if f.choices is not None and f.kind != "opt":
            kw["choices"] = f.choices
        if f.metavar:
            kw["metavar"] = f.metavar
        p.add_argument(*f.names, action=_Given, **kw)
        if f.neg:
            p.add_argument(*f.neg, action=_Given, negative=True, **{**kw, "nargs": 0})
    return p


def dashed_names(argv: list[str]) -> list[str]:
    """``--flag_with_underscores`` -> ``--flag-with-underscores`` when that is a known flag (a
    value after ``=`` is kept as given), as llama-server's argument parser and vLLM's
    ``FlexibleArgumentParser`` accept both spellings. Words after a bare ``--`` are untouched."""
    out: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return out + argv[i:]
        name, eq, value = word.partition("=")
        if name.startswith("--") and "_" in name and name.replace("_", "-") in BY_NAME:
            word = name.replace("_", "-") + eq + value
        out.append(word)
    return out


def fill_optional_values(argv: list[str]) -> list[str]:
    """Give each ``opt`` flag (``-fa``, ``-rea``, ...) its value explicitly: the next word when
    it is one of the flag's values, else the flag's ``const``. llama-server's ``-fa`` before a
    positional MODEL then never takes the model as its value. vLLM's ``-O3`` becomes ``-O 3``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if re.fullmatch(r"-O\d", word):  # vLLM's -O3: the compilation level attached
            out += ["-O", word[2:]]
            i += 1
            continue
        f = BY_NAME.get(word)
        if f is not None and f.kind == "opt" and word in f.names:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and f.choices is not None and nxt in f.choices:
                out += [word, nxt]
                i += 2
                continue
            out += [word, str(f.const)]
        else:
            out.append(word)
        i += 1
    return out


def config_file_argv(path: str) -> list[str]:
    """vLLM's ``--config FILE``: a YAML mapping of long flag names (without dashes; ``_`` or
    ``-``) to values, as command-line words. ``true`` gives the bare flag, ``false`` its
    negative spelling (or nothing), a list repeats the values after one flag.

    Raises:
        ValueError: the file is not such a mapping or names an unknown flag. OSError: unreadable.
    """
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")  # noqa: TRY004
    out: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if key == "model":
            out += [str(value)]
            continue
        f = BY_NAME.get(name)
        if f is None:
            raise ValueError(f"--config {path}: unknown flag {key!r}")
        if f.kind == "bool":
            if value is True:
                out.append(name)
            elif value is False and f.neg:
                out.append(f.neg[-1])
        elif isinstance(value, list):
            out += [name, *map(str, value)] if f.kind == "list" else [w for v in value for w in (name, str(v))]
        elif isinstance(value, dict):
            out += [name, json.dumps(value)]
        else:
            out += [name, str(value)]
    return out


# -- help and the README table --------------------------------------------------------------

def _describe(f: Flag) -> str:
    parts = []
    for negative in (False, True) if f.neg else (False,):
        effect, why = f.effect_for(negative)
        label = "" if not f.neg else ("no- forms: " if negative else "")
        if negative and (effect, why) == f.effect_for(False):
            continue
        text = {REAL: why, NONE: f"no effect: {why}", WARN: f"not available: {why}", REFUSE: f"refused: {why}"}[effect]
        if text:
            parts.append(label + text)
    return "; ".join(parts)


def _value_name(f: Flag) -> str:
    if f.kind == "bool":
        return ""
    if f.metavar:
        return f" {f.metavar}"
    if f.choices:
        return " {" + ",".join(f.choices) + "}" + ("?" if f.kind == "opt" else "")
    return {"int": " N", "float": " X", "list": " VALUE..."}.get(f.kind, " VALUE")


def help_text() -> str:
    """``kvserve serve --help``: every flag with its spellings, source tool, environment
    variables, default and what kvserve does with it, grouped by source."""
    lines = ["usage: kvserve serve [MODEL] [flags]", "",
             "Serve a model over HTTP: llama-server's and vLLM's flags are accepted. Each flag says the tool it",
             "comes from and what kvserve does with it (no effect / not available: accepted and logged; refused:",
             "the server does not start).", "", "  -h, --help, --usage  print this help and exit"]
    for source in (KV, LLAMA, BOTH, VLLM, OLLAMA):
        rows = [f for f in FLAGS if f.source == source]
        lines += ["", f"[{source}]"]
        for f in rows:
            head = f"  {f.spelled}{_value_name(f)}"
            detail = [f.help] if f.help else []
            desc = _describe(f)
            if desc and desc != f.help:
                detail.append(f"kvserve: {desc}" if f.effect != REAL else desc)
            if f.default not in (None, False, "") and f.kind != "bool":
                detail.append(f"default: {f.default}")
            if f.env:
                detail.append("env: " + ", ".join(f.env))
            detail.append(f"({source})")
            lines.append(head)
            lines.append("      " + ". ".join(detail))
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The README's flag table (``python -m kvserve.serving.flags --markdown``)."""
    out = ["| Flag | From | Environment | kvserve |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        what = _describe(f) or f.help
        if f.effect == REAL and not f.neg:
            what = "yes" + (f": {what}" if what else "")
        spelled = ", ".join(f"`{n}`" for n in f.names + f.neg)
        env = ", ".join(f"`{e}`" for e in f.env)
        out.append(f"| {spelled} | {f.source} | {env} | {what.replace('|', '/')} |")
    counts = {e: sum(1 for f in FLAGS if f.effect == e) for e in (REAL, NONE, WARN, REFUSE)}
    out += ["", (f"{len(FLAGS)} flags: {counts[REAL]} with effect, {counts[NONE]} accepted without effect, "
                f"{counts[WARN]} accepted with a warning (not available), {counts[REFUSE]} refused "
                "(some flags refuse single values: -tp/-pp/-dp above 1, -ctk/-ctv q4_1/iq4_nl/q5_0/q5_1, "
                "--kv-cache-dtype fp8_inc/fp8_ds_mla).")]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if "--markdown" in sys.argv[1:]:
        sys.stdout.write(markdown_table())
    else:
        sys.stdout.write(help_text())
