"""The model's own sampling defaults: an HF directory's ``generation_config.json`` (vLLM's
``--generation-config``) and a GGUF file's ``general.sampling.*`` keys (llama.cpp's).

Model authors save the sampling settings that work best for their model; kvserve applies them
as the defaults of every request that leaves the field out, per loaded model, on every face.

Where a request's sampling field comes from, first that applies (:func:`model_defaults`):

1. the request's own field (every face; Ollama's ``options``);
2. ``--override-generation-config`` (vLLM), then a sampling flag given on the command line or
   in the environment (``--temp``, ``--top-k``, ``--top-p``, ``--min-p``, ``--repeat-penalty``,
   ``-n``, ``--repeat-last-n``, ``--samplers``, ``--xtc-*``; ``LLAMA_ARG_*``): an explicit
   choice of the user's wins over the model's file, as llama.cpp does for ``general.sampling.*``;
3. the model's file:

   * an HF directory (``--generation-config auto``, the default) or ``--generation-config DIR``:
     ``generation_config.json``'s ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``,
     ``min_p`` and ``max_new_tokens`` (-> ``n_predict``/``max_tokens``), as vLLM's
     ``ModelConfig.get_diff_sampling_param`` keeps them (null values and every other key, such
     as ``bos_token_id`` or ``do_sample``, are dropped). When the file sets any of the five
     sampling keys, the other ones start from vLLM's neutral values (temperature 1.0, top_p
     1.0, top_k 0 = off, min_p 0.0, repetition_penalty 1.0), not llama-server's 0.8/0.95/40/0.05,
     so the authors' recipe runs as vLLM and transformers run it; and a ``repetition_penalty``
     from the file penalizes every prompt and output token (``repeat_last_n`` -1), as theirs does;
   * a GGUF file (``auto``): ``general.sampling.{sequence, top_k, top_p, min_p,
     xtc_probability, xtc_threshold, temp, penalty_last_n, penalty_repeat}`` over llama-server's
     defaults, as llama.cpp's ``common_init_sampler_from_model`` applies them (``mirostat``,
     ``mirostat_tau`` and ``mirostat_eta`` are logged and ignored: kvserve has no mirostat);
   * ``--generation-config vllm``, given on the command line (or ``LLAMA_ARG_``/env): no file,
     and vLLM's neutral values (temperature 1.0, top_p 1.0, top_k 0, min_p 0.0,
     repetition_penalty 1.0) in place of llama-server's, as seed 002 Example 14 says vLLM runs
     then: the user typed a vLLM flag;
4. kvserve's defaults (llama-server's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05...):
   kvserve serves llama-server's users too, whose default is no flag at all, so ``auto`` with no
   model file (a GGUF without ``general.sampling.*``) keeps them.

The Ollama face layers Ollama's own way (:func:`ollama_layer`): Ollama's defaults, then the
model's file, then the store model's params layer (its Modelfile ``PARAMETER`` lines), then the
request's ``options``; the server's sampling flags do not apply there (as before).

A model whose file sets anything logs vLLM's start-up warning (:func:`overridden_line`), with
kvserve for vLLM: ``Default kvserve sampling parameters have been overridden by the model's
`generation_config.json`: `{'temperature': 0.7, ...}`. If this is not intended, please relaunch
kvserve with `--generation-config vllm`.``

Differences from vLLM, on purpose: a ``generation_config.json`` key is kept when present
(vLLM's ``to_diff_dict`` drops values equal to transformers' defaults of the installed
version); ``max_new_tokens`` is a default that a request's ``max_tokens`` replaces (vLLM takes
the smaller of the two); a default length (``max_new_tokens``, the override's, ``-n``) larger
than the room left in the context is capped to that room (``SamplingParams.n_predict_default``,
vLLM's ``get_max_tokens``: ``min(default, max_model_len - prompt_len)``), never refused, while
a request's own ``max_tokens`` over the context is still a 400; ``--generation-config DIR`` without a readable ``generation_config.json``
is a start-up error (vLLM ignores it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import InvalidRequestError, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.args import ServerArgs

FILE_NAME = "generation_config.json"

#: the generation_config.json keys vLLM uses, in its order (``get_diff_sampling_param``)
VLLM_PARAMS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")

#: vLLM's neutral values (``_DEFAULT_SAMPLING_PARAMS`` of its chat protocol)
VLLM_NEUTRAL: dict[str, Any] = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                "min_p": 0.0}

#: vLLM name -> SamplingParams field
_HF_FIELDS = {"repetition_penalty": "repeat_penalty", "temperature": "temperature", "top_k": "top_k",
              "top_p": "top_p", "min_p": "min_p", "max_tokens": "n_predict"}

#: GGUF key -> SamplingParams field (llama.cpp's ``LLAMA_MODEL_META_KEY_SAMPLING_*``)
GGUF_KEYS = {
    "general.sampling.sequence": "samplers",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.xtc_probability": "xtc_probability",
    "general.sampling.xtc_threshold": "xtc_threshold",
    "general.sampling.temp": "temperature",
    "general.sampling.penalty_last_n": "repeat_last_n",
    "general.sampling.penalty_repeat": "repeat_penalty",
}
#: llama.cpp reads these too; kvserve has no mirostat sampler
GGUF_IGNORED = ("general.sampling.mirostat", "general.sampling.mirostat_tau", "general.sampling.mirostat_eta")

#: SamplingParams field -> the ServerArgs.flags_given dest of its flag
_FLAG_OF = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repeat_penalty": "repeat_penalty", "n_predict": "predict", "repeat_last_n": "repeat_last_n",
            "xtc_probability": "xtc_probability", "xtc_threshold": "xtc_threshold", "samplers": "samplers"}

#: --override-generation-config key -> SamplingParams field (args.py folds these into the flags' values)
_OVERRIDE_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repeat_penalty", "max_new_tokens": "n_predict",
                    "max_tokens": "n_predict"}

_INT_FIELDS = ("top_k", "n_predict", "repeat_last_n")

#: SamplingParams field -> Ollama option name
_OLLAMA_OPTION = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "n_predict": "num_predict"}


class GenerationConfigError(ValueError):
    """A ``--generation-config`` value that is not ``auto``, ``vllm`` or a directory with a
    readable ``generation_config.json`` holding a JSON object."""


@dataclass
class ModelDefaults:
    """One model's sampling defaults and where they came from.

    Attributes:
        params: the server defaults of this model's requests (flags, the model's file and
            ``--override-generation-config`` merged as the module docstring says).
        source: ``"generation_config.json"``, ``"gguf"`` or ``""`` (nothing read).
        path: the file read (``.../generation_config.json`` or the ``.gguf``), or None.
        diff: what the model's file sets: vLLM's ``get_diff_sampling_param`` result (vLLM names,
            ``max_tokens``; ``--override-generation-config`` applied) for an HF file, the
            ``general.sampling.*`` values by key suffix (``temp``, ``top_k``...) for a GGUF. This is
            what the start-up line shows.
        file_values: SamplingParams field -> every value the model's file sets that kvserve can
            use (what the Ollama face layers, :func:`ollama_layer`).
        applied: the part of ``file_values`` this model's defaults took (the flags and the
            override keep theirs).
        notes: further log lines ``(level, text)``: a flag that won over the file, a value of
            the file that is refused.
    """

    params: SamplingParams
    source: str = ""
    path: str | None = None
    diff: dict = field(default_factory=dict)
    file_values: dict = field(default_factory=dict)
    applied: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def log_line(self) -> str | None:
        """vLLM's start-up warning for this model (:func:`overridden_line`), or None when the
        model's file sets nothing."""
        if not self.diff or not self.source:
            return None
        return overridden_line(self.diff, self.source)


def overridden_line(diff: dict, source: str = FILE_NAME) -> str:
    """vLLM's warning when a model's file changed the defaults, with kvserve for vLLM:

    ``Default kvserve sampling parameters have been overridden by the model's
    `generation_config.json`: `{'repetition_penalty': 1.05, 'temperature': 0.7}`. If this is not
    intended, please relaunch kvserve with `--generation-config vllm`.``

    ``source`` ``"gguf"`` names the GGUF keys instead: ``the model's `general.sampling.*` GGUF
    metadata``. The dict is written as Python writes it (vLLM's text).
    """
    what = "`general.sampling.*` GGUF metadata" if source == "gguf" else f"`{FILE_NAME}`"
    return (f"Default kvserve sampling parameters have been overridden by the model's {what}: `{diff!r}`. "
            "If this is not intended, please relaunch kvserve with `--generation-config vllm`.")


def check_generation_config(value: str) -> str | None:
    """The ``--generation-config`` value check: None when fine, else the error text (the
    server then does not start)."""
    if value in ("auto", "vllm"):
        return None
    try:
        read_generation_config(value, required=True)
    except GenerationConfigError as e:
        return str(e)
    return None


def read_generation_config(directory: str | os.PathLike, *, required: bool = False) -> dict:
    """``directory/generation_config.json`` as a dict (``directory`` may name the file itself).

    Args:
        directory: an HF model directory, or ``--generation-config DIR``.
        required: raise when the file is missing or unreadable (``--generation-config DIR``);
            otherwise such a file reads as ``{}`` (an HF directory without one).

    Raises:
        GenerationConfigError: a JSON text that is not an object (always), a missing or
            unreadable file (``required``).
    """
    p = Path(directory)
    f = p if p.is_file() else p / FILE_NAME
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if required:
            raise GenerationConfigError(f"invalid --generation-config {str(directory)!r}: 'auto', 'vllm' or a "
                                        f"directory holding {FILE_NAME} ({e.__class__.__name__}: "
                                        f"{getattr(e, 'strerror', None) or e})") from None
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise GenerationConfigError(f"{f}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{f}: a JSON object expected, got {type(data).__name__}")
    return data


def diff_sampling_params(file_config: dict, override: dict | None = None) -> dict:
    """vLLM's ``ModelConfig.get_diff_sampling_param``: the keys of ``file_config`` (then
    ``override`` over it) that vLLM uses, in :data:`VLLM_PARAMS` order, null values dropped,
    ``max_new_tokens`` renamed ``max_tokens``. Seed 002 Example 14::

        diff_sampling_params({"bos_token_id": 151643, "do_sample": True, "repetition_penalty": 1.05,
                              "temperature": 0.7, "top_k": 20, "top_p": 0.8})
        == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    """
    config = {**file_config, **(override or {})}
    out: dict[str, Any] = {}
    for key in VLLM_PARAMS:
        if config.get(key) is not None:
            out["max_tokens" if key == "max_new_tokens" else key] = config[key]
    return out


def gguf_sampling(metadata: dict) -> dict:
    """The ``general.sampling.*`` keys of a GGUF's metadata that kvserve reads (and the ignored
    mirostat ones), by key suffix: ``{"temp": 0.6, "top_k": 20}``. Float32 values are written
    at their shortest decimal (0.6, not 0.6000000238418579), as llama.cpp's text round trip
    reads them."""
    import numpy as np

    out: dict[str, Any] = {}
    for key in (*GGUF_KEYS, *GGUF_IGNORED):
        v = metadata.get(key)
        if v is None:
            continue
        if isinstance(v, float) and math.isfinite(v):
            v = float(str(np.float32(v)))
        out[key[len("general.sampling."):]] = v
    return out


def _explicit(args: ServerArgs) -> dict[str, str]:
    """SamplingParams field -> how the user set it: the flag or environment variable as given
    (``--temperature``, ``LLAMA_ARG_TOP_K``), or ``""`` for ``--override-generation-config``."""
    given = getattr(args, "flags_given", {}) or {}
    out = {name: given[dest] for name, dest in _FLAG_OF.items() if dest in given}
    for key in override_values(getattr(args, "override_generation_config", None)):
        out[_OVERRIDE_FIELDS[key]] = ""
    return out


def override_values(override: dict | None) -> dict[str, Any]:
    """The ``--override-generation-config`` keys kvserve uses (vLLM names, as given): a number
    (not a boolean) for one of ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``max_new_tokens``, ``max_tokens``. Every other key or value (a
    string, null, true) is logged as ignored by the flag parser and leaves the model's file value
    in place. (Their ranges are checked by :func:`check_value` when the flags are parsed.)"""
    return {k: v for k, v in (override or {}).items()
            if k in _OVERRIDE_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)}


#: the largest finite float32: a float default must fit it (Ollama's options are float32, and
#: so are the sampler's tensors)
_FLOAT32_MAX = 3.4028234663852886e38
#: integer defaults are llama.cpp's int32 parameters
_INT_MAX = 2**31 - 1


def check_value(name: str, value: Any) -> Any:
    """A sampling default (the model's file or ``--override-generation-config``) as the
    SamplingParams field ``name``'s type, refused when a request's own field would be refused.

    Rules: a number (not a boolean), finite, within float32 (|v| <= 3.4e38); ``top_k``,
    ``n_predict`` (``max_new_tokens``) and ``repeat_last_n`` integral and below 2**31;
    ``top_k`` -1 is 0 (vLLM's and llama.cpp's "off"; below -1 is refused, as vLLM does); ``n_predict`` >= 1; ``temperature``
    >= 0 (vLLM's rule); ``repeat_penalty`` > 0 (vLLM's); ``top_p``, ``min_p`` in [0, 1] and the
    rest as :class:`SamplingParams` checks them. ``samplers``: a ``;``-separated list of names.

    Raises:
        ValueError: the reason, written for the "is not used" warning / the start-up error.
    """
    value = _coerce(name, value)
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as e:
        raise ValueError(str(e)) from None
    return value


def _coerce(name: str, value: Any) -> Any:
    """A file's value as the SamplingParams field's type; ValueError when it is not one."""
    if name == "samplers":
        from kvserve.engine.sampler import resolve_sampler_names

        names = value.split(";") if isinstance(value, str) else value
        if not isinstance(names, list | tuple) or not names:
            raise ValueError("a ';'-separated list of sampler names expected")
        try:
            return resolve_sampler_names([n.strip() for n in names if isinstance(n, str) and n.strip()])
        except InvalidRequestError as e:
            raise ValueError(str(e)) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("a number expected")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a finite number expected")
    if name in _INT_FIELDS:
        if value != int(value):
            raise ValueError("an integer expected")
        value = int(value)
        if value > _INT_MAX:
            raise ValueError(f"at most {_INT_MAX} expected")
        if name == "top_k" and value < -1:
            raise ValueError("-1 or 0 (off) or at least 1 expected")  # vLLM's rule
        if name == "top_k" and value < 0:
            return 0  # vLLM's and llama.cpp's "off"
        if name == "n_predict" and value < 1:
            raise ValueError("at least 1 expected")
        return value
    if abs(value) > _FLOAT32_MAX:
        raise ValueError("out of range (float32)")
    value = float(value)
    if name == "temperature" and value < 0:
        raise ValueError("at least 0 expected")
    if name == "repeat_penalty" and value <= 0:
        raise ValueError("above 0 expected")
    return value


def _model_file(args: ServerArgs, model_path: str | None, metadata: dict | None) -> tuple[str, str | None, dict]:
    """(source, path, raw values) of the model's file under ``--generation-config``."""
    mode = getattr(args, "generation_config", "auto") or "auto"
    if mode == "vllm":
        return "", None, {}
    if mode != "auto":
        p = Path(mode)
        return FILE_NAME, str(p if p.is_file() else p / FILE_NAME), read_generation_config(mode, required=True)
    if model_path and Path(model_path).is_dir():
        f = Path(model_path) / FILE_NAME
        return (FILE_NAME, str(f), read_generation_config(model_path)) if f.is_file() else ("", None, {})
    found = gguf_sampling(metadata or {})
    return ("gguf", model_path, found) if found else ("", None, {})


def model_defaults(args: ServerArgs, model_path: str | None = None, metadata: dict | None = None) -> ModelDefaults:
    """One model's request defaults: the flags' (:meth:`ServerArgs.default_sampling_params`,
    ``--override-generation-config`` folded in) with the model's file applied as the module
    docstring says.

    Args:
        args: the server's flags (``generation_config``, ``override_generation_config``,
            ``flags_given``).
        model_path: the model's ``.gguf`` file or HF directory.
        metadata: the GGUF's metadata (``ModelInfo.metadata``); None for an HF directory.

    Never raises for a bad model file: an unreadable ``generation_config.json`` or a value
    out of range is a warning in :attr:`ModelDefaults.notes` and is not applied.
    """
    base = args.default_sampling_params()
    try:
        source, path, raw = _model_file(args, model_path, metadata)
    except GenerationConfigError as e:
        return ModelDefaults(_default_length(base),
                             notes=[(logging.WARNING, f"the model's sampling defaults are not used: {e}")])
    if not raw:
        if (getattr(args, "generation_config", "auto") == "vllm"
                and "generation_config" in (getattr(args, "flags_given", None) or {})):
            # `--generation-config vllm` typed: vLLM's neutral values (a flag or the override keeps its own)
            explicit = _explicit(args)
            base = dataclasses.replace(base, **{_HF_FIELDS[k]: v for k, v in VLLM_NEUTRAL.items()
                                                if _HF_FIELDS[k] not in explicit})
        return ModelDefaults(_default_length(base))
    out = ModelDefaults(base, source, path)
    # (SamplingParams field, the file's key or None for a value kvserve fills in, value), in the
    # order they apply: a file's value that is refused leaves the one before it
    wanted: list[tuple[str, str | None, Any]] = []
    # the file's values kvserve can use (refused ones are warned about here and left out of
    # everything after: the neutral base, the start-up line, the defaults)
    if source == "gguf":
        for key, value in raw.items():
            full = "general.sampling." + key
            if full in GGUF_IGNORED:
                out.diff[key] = value
                out.notes.append((logging.INFO, f"model's {full} = {value!r} is ignored: kvserve has no mirostat"))
            elif (v := _checked(out, GGUF_KEYS[full], full, value)) is not None:
                out.diff[key] = value
                wanted.append((GGUF_KEYS[full], full, v))
    else:
        usable = {}
        for name, value in diff_sampling_params(raw).items():
            if (v := _checked(out, _HF_FIELDS[name], name, value)) is not None:
                usable[name] = v
        override = override_values(getattr(args, "override_generation_config", None))
        out.diff = diff_sampling_params({("max_new_tokens" if k == "max_tokens" else k): v
                                         for k, v in usable.items()}, override)
        if any(k in usable for k in VLLM_NEUTRAL):  # the recipe's other fields: vLLM's neutral ones
            wanted += [(_HF_FIELDS[name], None, value) for name, value in VLLM_NEUTRAL.items()]
        if "repetition_penalty" in usable:  # vLLM penalizes every prompt and output token
            wanted.append(("repeat_last_n", None, -1))
        wanted += [(_HF_FIELDS[name], name, value) for name, value in usable.items()]
    explicit = _explicit(args)
    params = base
    for name, key, value in wanted:
        if key is not None:
            out.file_values[name] = value
        if name in explicit:
            if key is not None and explicit[name]:
                out.notes.append((logging.INFO, f"flag {explicit[name]} wins over the model's {key} = {value!r}"))
            continue
        params = dataclasses.replace(params, **{name: value})
        if key is not None:
            out.applied[name] = value
    out.params = _default_length(params)
    return out


def _default_length(params: SamplingParams) -> SamplingParams:
    """Mark a default ``n_predict`` (``-n``, the override, the file's ``max_new_tokens``) as one:
    the engine caps it to the room left in the context, as vLLM's ``get_max_tokens`` does."""
    return dataclasses.replace(params, n_predict_default=params.n_predict > 0)


def _checked(out: ModelDefaults, name: str, key: str, value: Any) -> Any:
    """:func:`check_value` of one value of the model's file, or None (and a warning in
    ``out.notes``) when it is refused."""
    try:
        return check_value(name, value)
    except ValueError as e:
        out.notes.append((logging.WARNING, f"the model's {key} = {value!r} is not used: {e}"))
        return None


def ollama_layer(defaults: ModelDefaults | None) -> dict:
    """The model's file values as Ollama options (``temperature``, ``top_k``, ``num_predict``...):
    the layer the Ollama face puts between Ollama's defaults and the store model's params
    layer. Flags and ``--override-generation-config`` are not in it (they do not apply on the
    Ollama face), nor vLLM's neutral values (Ollama's own defaults stand for those)."""
    if defaults is None:
        return {}
    return {_OLLAMA_OPTION[k]: v for k, v in defaults.file_values.items() if k in _OLLAMA_OPTION}


__all__ = [
    "FILE_NAME",
    "GGUF_IGNORED",
    "GGUF_KEYS",
    "VLLM_NEUTRAL",
    "VLLM_PARAMS",
    "GenerationConfigError",
    "ModelDefaults",
    "check_generation_config",
    "check_value",
    "diff_sampling_params",
    "gguf_sampling",
    "model_defaults",
    "ollama_layer",
    "overridden_line",
    "override_values",
    "read_generation_config",
]
