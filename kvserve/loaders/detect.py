"""Which model format a path holds, which engines run it, and whether kvserve does.

One table (:data:`FORMATS`) pairs each format with the engines that read it and what kvserve
offers instead; one ordered list of rules (:data:`RULES`, first match wins) decides the format
of a file listing. The rules are the seed's (004 Examples 8 and 10, 002 Example 6), in its order:

=====================  ====================================================================
rule                   decides
=====================  ====================================================================
a ``.gguf`` file       GGUF (llama.cpp, Ollama, LM Studio): kvserve runs the families it knows
genai_config.json      ONNX Runtime GenAI (graph ``.onnx`` + ``.onnx.data`` + tokenizer)
``rank*.engine`` or    TensorRT-LLM engine (built for one NVIDIA GPU by ``trtllm-build``)
config.json with
pretrained_config +
build_config
measurement.json or    EXL2 (ExLlamaV2) / EXL3 (ExLlamaV3): TabbyAPI
quant_method exl2/3
config.json            MLX (mlx-lm): quantized MLX weights kvserve cannot unpack
``quantization``
{bits, group_size},
or mlx-community name
``*.safetensors``      HF safetensors: kvserve runs it (plain, or AWQ/GPTQ/FP8/compressed-
+ config.json          tensors per ``quantization_config``); other quant_methods are refused
``pytorch_model*.bin`` HF PyTorch checkpoint: kvserve reads it (``torch.load(weights_only)``)
a lone ``.onnx``       an ONNX export without generation settings
=====================  ====================================================================

The seed notes that measurement.json as the EXL2 marker is an assumption of its example, not a
documented rule; kvserve also takes ``quantization_config.quant_method`` ``exl2``/``exl3``.

:func:`detect` reads only names, config.json and (for a GGUF) its header: it never loads
weights. :meth:`Detection.require_loadable` raises the one-line refusal that ``serve``, ``run``,
``create``, ``/api/create`` and on-demand loads give for a format kvserve cannot run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from kvserve.errors import NotSupportedError
from kvserve.loaders.weights import ModelLoadError

__all__ = ["FORMATS", "Detection", "Format", "UnsupportedFormatError", "detect", "detect_files",
           "require_loadable"]

#: at most this many directory entries are read (a folder of a million files is not a model)
MAX_ENTRIES = 10_000
#: config.json larger than this is not read (real ones are a few KiB)
MAX_CONFIG_BYTES = 4 << 20

GGUF_MAGIC = b"GGUF"


class UnsupportedFormatError(NotSupportedError, ModelLoadError):
    """A model in a format kvserve cannot run; the message is the format's one-line refusal
    (its format, the engines that run it, kvserve's alternatives). A NotSupportedError for the
    faces and a ModelLoadError for the loaders' callers."""


@dataclass(frozen=True)
class Format:
    """One row of the format table.

    Attributes:
        key: a stable id (``gguf``, ``safetensors``, ``onnx-genai``...), shown by ``kvserve show``.
        label: what the folder or file is, in kvserve's words (``ONNX Runtime GenAI model folder``).
        engines: the engines that run it, as their projects name them ("" when the folder is
            not a model any engine runs as it is).
        runs: whether kvserve runs it itself (the families and quantizations permitting).
        instead: what to give kvserve instead (``a GGUF or HF safetensors copy``), for a refusal.
        supervise: an engine command kvserve can supervise for it (``--engine``), "" when none
            speaks HTTP.
    """

    key: str
    label: str
    engines: str
    runs: bool
    instead: str = "a GGUF or HF safetensors copy"
    supervise: str = ""


_COPY = "a GGUF or HF safetensors copy"

#: every format kvserve tells apart, by key
FORMATS: dict[str, Format] = {f.key: f for f in (
    Format("gguf", "GGUF file", "llama.cpp (llama-server), Ollama, LM Studio", True,
           "a GGUF of a family it knows", supervise="llama-server -m {model} --port {port}"),
    Format("gguf-folder", "folder of GGUF files", "", False, "the path of the one to load"),
    Format("safetensors", "HF safetensors folder", "vLLM, SGLang, TGI, Transformers, "
           "TensorRT-LLM (after its build step)", True, "a GGUF copy of a family it knows", supervise="vllm serve {model} --port {port}"),
    Format("safetensors-quantized", "HF safetensors folder, quantized", "vLLM, SGLang, Transformers", True,
           "a GGUF copy or an AWQ, GPTQ, FP8 or compressed-tensors checkpoint",
           supervise="vllm serve {model} --port {port}"),
    Format("pytorch-bin", "HF PyTorch .bin folder", "Transformers, vLLM", True,
           "a GGUF copy of a family it knows", supervise="vllm serve {model} --port {port}"),
    Format("exl2", "EXL2 model folder", "ExLlamaV2 (TabbyAPI)", False, _COPY),
    Format("exl3", "EXL3 model folder", "ExLlamaV3 (TabbyAPI)", False, _COPY),
    Format("onnx-genai", "ONNX Runtime GenAI model folder", "onnxruntime-genai", False, _COPY),
    Format("onnx", "ONNX export without genai_config.json", "ONNX Runtime (one forward pass at a time, "
           "no generation settings)", False, _COPY),
    Format("mlx", "MLX model folder", "mlx-lm (mlx_lm.server), LM Studio or Ollama on Apple Silicon", False,
           _COPY, supervise="mlx_lm.server --model {model} --port {port}"),
    Format("tensorrt-llm", "TensorRT-LLM engine folder", "TensorRT-LLM (trtllm-serve) on the NVIDIA GPU it was "
           "built for", False, "the HF safetensors checkpoint it was built from, or a GGUF copy",
           supervise="trtllm-serve {model} --port {port}"),
    Format("hf-no-weights", "HF folder without weights (config.json but no *.safetensors or "
           "pytorch_model*.bin)", "", False, "the folder with its weights files"),
    Format("not-gguf", "file that is not GGUF (no GGUF magic)", "", False, "a .gguf file or an HF model folder"),
    Format("unknown", "folder with no model kvserve recognizes (no config.json, .gguf or genai_config.json)",
           "", False, "a .gguf file or an HF model folder (see the model card for its format)"),
)}


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found.

    Attributes:
        path: the path examined.
        format: its :class:`Format`.
        detail: facts behind the decision (``quant_method awq``, ``bits 4, group_size 64``,
            ``graph, external weights, tokenizer``), "" when none.
        problem: why kvserve cannot run this instance of a format it runs (an unknown family, a
            quantization method it lacks), "" when none.
        weights: the file kvserve loads for a GGUF folder holding one model GGUF, else None.
    """

    path: str
    format: Format
    detail: str = ""
    problem: str = ""
    weights: str | None = None

    @property
    def loadable(self) -> bool:
        """True when kvserve runs it itself."""
        return self.format.runs and not self.problem

    def refusal(self) -> str:
        """The one line a refused model gets: ``PATH: FORMAT (detail): kvserve cannot run it;
        run it with ENGINES, or give kvserve INSTEAD`` (no ``PATH: `` for a listing without one)."""
        f = self.format
        what = f"{f.label} ({self.detail})" if self.detail else f.label
        why = f"kvserve cannot run it ({self.problem})" if self.problem else "kvserve cannot run it"
        run = f"run it with {f.engines}, or " if f.engines else ""
        where = f"{self.path}: " if self.path else ""
        return f"{where}{what}: {why}; {run}give kvserve {f.instead}"

    def report(self) -> str:
        """``kvserve show PATH``'s text: the format, its engines and what kvserve does with it
        (several lines, each ``  key  value``)."""
        f = self.format
        rows = [("path", self.path), ("format", f"{f.label} [{f.key}]")]
        if self.detail:
            rows.append(("detail", self.detail))
        rows.append(("engines", f.engines or "none"))
        if self.loadable:
            target = self.weights or self.path
            rows.append(("kvserve", f"loads it ({target})"))
        else:
            why = f" ({self.problem})" if self.problem else ""
            rows.append(("kvserve", f"refuses it{why}: give kvserve {f.instead}"))
            if f.supervise:
                cmd = f.supervise.format(model=self.path, port="{port}")
                rows.append(("supervise", f"kvserve serve --engine 'NAME={cmd}' (when {cmd.split()[0]} is "
                                          f"installed)"))
        width = max(len(k) for k, _ in rows)
        return "".join(f"  {k:<{width}}    {v}\n" for k, v in rows)

    def require_loadable(self) -> "Detection":
        """Self when the format is one kvserve runs. A :attr:`problem` inside such a format (an
        unknown family, a quantization method kvserve lacks) is left to the loaders, whose
        messages name what kvserve runs instead.

        A file that is not GGUF is left to the GGUF loader too (its message names the bad magic).

        Raises:
            UnsupportedFormatError: the :meth:`refusal` line, for a format kvserve does not run.
        """
        if not self.format.runs and self.format.key != "not-gguf":  # that one: the GGUF loader names its magic
            raise UnsupportedFormatError(self.refusal())
        return self


# ------------------------------------------------------------------------------------ rules

@dataclass(frozen=True)
class Listing:
    """What the rules read: the folder's file names (relative, ``/``-separated, top level and
    one level down), its config.json (None when absent or unreadable) and its path."""

    names: frozenset[str]
    config: dict | None
    path: str
    deep: bool = True

    def any(self, pred: Callable[[str], bool]) -> list[str]:
        return sorted(n for n in self.names if "/" not in n and pred(n))

    def has(self, name: str) -> bool:
        return name in self.names


def _gguf(ls: Listing) -> Detection | None:
    found = ls.any(lambda n: n.lower().endswith(".gguf"))
    if not found:
        return None
    models = [n for n in found if "mmproj" not in n.lower()]
    detail = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if len(models) != 1:
        return Detection(ls.path, FORMATS["gguf-folder"], detail,
                         problem=f"{len(models)} model GGUF files" if models else
                         "only projector (mmproj) files: kvserve has no vision models")
    if not ls.deep:
        return Detection(ls.path, FORMATS["gguf"], detail, weights=os.path.join(ls.path, models[0]))
    return _gguf_file(os.path.join(ls.path, models[0]), detail=detail, shown=ls.path)


def _onnx_genai(ls: Listing) -> Detection | None:
    if not ls.has("genai_config.json"):
        return None
    parts = [("graph", ls.any(lambda n: n.endswith(".onnx"))),
             ("external weights", ls.any(lambda n: n.endswith(".onnx.data") or n.endswith(".onnx_data"))),
             ("tokenizer", ls.any(lambda n: n in ("tokenizer.json", "tokenizer.model")))]
    detail = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in parts)
    return Detection(ls.path, FORMATS["onnx-genai"], detail)


def _tensorrt_llm(ls: Listing) -> Detection | None:
    engines = ls.any(lambda n: re.fullmatch(r"rank\d+\.engine", n) is not None)
    cfg = ls.config or {}
    if not engines and not ("pretrained_config" in cfg and "build_config" in cfg):
        return None
    arch = (cfg.get("pretrained_config") or {}).get("architecture") if isinstance(cfg.get("pretrained_config"), dict) \
        else None
    bits = [f"{len(engines)} rank engine file{'s' if len(engines) != 1 else ''}"]
    if arch:
        bits.append(f"architecture {arch}")
    return Detection(ls.path, FORMATS["tensorrt-llm"], ", ".join(bits))


def _quant_method(cfg: dict | None) -> str:
    from kvserve.loaders.hf_quant import quantization_config

    qc = quantization_config(cfg or {})
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""


def _exllama(ls: Listing) -> Detection | None:
    method = _quant_method(ls.config)
    if method == "exl3":
        return Detection(ls.path, FORMATS["exl3"], "quant_method exl3")
    if ls.has("measurement.json") or method == "exl2":
        return Detection(ls.path, FORMATS["exl2"], "measurement.json" if ls.has("measurement.json")
                         else "quant_method exl2")
    return None


#: a folder named as MLX conversions are (``Qwen3-8B-MLX-4bit``, ``qwen3-mlx``)
_MLX_NAME = re.compile(r"[-_]mlx([-_]|$)", re.IGNORECASE)


def _mlx(ls: Listing) -> Detection | None:
    q = (ls.config or {}).get("quantization")
    if isinstance(q, dict) and ("bits" in q or "group_size" in q):
        return Detection(ls.path, FORMATS["mlx"], f"quantization bits {q.get('bits')}, group_size "
                                                  f"{q.get('group_size')}")
    if ls.config is None or not ls.path:
        return None
    parts = Path(ls.path).resolve().parts
    # mlx-community/NAME, or the HF cache's models--mlx-community--NAME/snapshots/<commit>
    named = next((p for p in parts[-4:] if "mlx-community" in p.lower()), None)
    if named is None and _MLX_NAME.search(parts[-1]):
        named = parts[-1]
    return Detection(ls.path, FORMATS["mlx"], f"named '{named}'") if named is not None else None


def _hf(ls: Listing) -> Detection | None:
    if ls.config is None:
        return None
    shards = ls.any(lambda n: n.endswith(".safetensors"))
    bins = ls.any(lambda n: re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", n) is not None)
    if not shards and not bins:
        if ls.any(lambda n: n.startswith("consolidated") and n.endswith(".pth")):
            return Detection(ls.path, FORMATS["hf-no-weights"], "consolidated*.pth: Meta's original checkpoint")
        return Detection(ls.path, FORMATS["hf-no-weights"])
    kind = "safetensors" if shards else "pytorch-bin"
    n = len(shards or bins)
    detail = f"{n} {'safetensors' if shards else '.bin'} file{'s' if n != 1 else ''}"
    method = _quant_method(ls.config)
    if method:
        kind = "safetensors-quantized" if shards else kind
        detail += f", quant_method {method}"
    problem = _hf_problem(ls) if ls.deep else ""
    return Detection(ls.path, FORMATS[kind], detail, problem)


def _hf_problem(ls: Listing) -> str:
    """Why kvserve cannot run this HF checkpoint (its quantization, its architecture), else ""."""
    from kvserve.loaders.hf_quant import read_scheme
    from kvserve.models.family import hf_family

    try:
        read_scheme(ls.config, ls.path)
    except ModelLoadError:
        return f"quant_method '{_quant_method(ls.config)}'; kvserve runs AWQ, GPTQ, FP8 and compressed-tensors"
    try:
        hf_family(ls.config, ls.path)
    except ModelLoadError:
        archs = ls.config.get("architectures") or ls.config.get("model_type")
        return f"kvserve has no family for {archs!r}"
    return ""


def _onnx(ls: Listing) -> Detection | None:
    graphs = ls.any(lambda n: n.endswith(".onnx"))
    return Detection(ls.path, FORMATS["onnx"], f"{len(graphs)} .onnx file(s)") if graphs else None


#: the rules in the order they apply (first match wins): the seed's order, then the rest
RULES: tuple[Callable[[Listing], Detection | None], ...] = (
    _gguf, _onnx_genai, _tensorrt_llm, _exllama, _mlx, _hf, _onnx)


# --------------------------------------------------------------------------------- entry points

def detect_files(names: Iterable[str], config: dict | None = None, path: str = "") -> Detection:
    """The format of a listing of file names (``/``-separated paths inside the model folder),
    with its config.json already parsed (``None``: none), as the seed classifies a repository's
    listing (names and config only: no GGUF header, family or quantization check)."""
    ls = Listing(frozenset(names), config if isinstance(config, dict) else None, path, deep=False)
    for rule in RULES:
        found = rule(ls)
        if found is not None:
            return found
    return Detection(path, FORMATS["unknown"])


def _gguf_file(path: str, detail: str = "", shown: str | None = None) -> Detection:
    """A GGUF file: loadable when a family of kvserve reads its architecture."""
    from kvserve.loaders.gguf import read_gguf_header
    from kvserve.models.family import GGUF_ARCHS

    shown = shown or path
    try:
        md, _ = read_gguf_header(path)
    except Exception as e:  # noqa: BLE001 - a damaged header is reported as the file's problem
        return Detection(shown, FORMATS["gguf"], detail, problem=f"unreadable GGUF header: {e}", weights=path)
    arch = str(md.get("general.architecture") or "")
    bits = [b for b in (detail, f"architecture {arch}" if arch else "") if b]
    problem = ""
    if md.get("general.type") == "adapter":  # `kvserve serve` would stop on a missing model key
        problem = ("a LoRA adapter, not a model: give it to --lora (or --lora-modules, a Modelfile's ADAPTER) "
                   "with its base model")
    elif arch and arch not in GGUF_ARCHS and md.get("general.type") not in ("projector", "mmproj"):
        problem = f"kvserve has no family for architecture '{arch}'"
    return Detection(shown, FORMATS["gguf"], ", ".join(bits), problem, weights=path)


def _read_config(d: Path) -> dict | None:
    p = d / "config.json"
    try:
        if not p.is_file() or p.stat().st_size > MAX_CONFIG_BYTES:
            return None
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _names(d: Path) -> frozenset[str]:
    out: list[str] = []
    try:
        with os.scandir(d) as it:
            for i, entry in enumerate(it):
                if i >= MAX_ENTRIES:
                    break
                out.append(entry.name)
    except OSError:
        pass
    return frozenset(out)


def detect(path: str | os.PathLike, deep: bool = True) -> Detection:
    """The format of the file or folder at ``path`` (a store blob is a file: judged by its
    magic, not its name). ``deep``: also read a GGUF's header and check an HF checkpoint's
    family and quantization (:attr:`Detection.problem`); without it only names, magic and
    config.json are read (what a load path needs before the loaders run).

    Raises:
        FileNotFoundError: nothing is at ``path``.
    """
    p = Path(path).expanduser()
    shown = str(path)
    if p.is_file():
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise FileNotFoundError(f"{shown}: {e.strerror}") from None
        if magic == GGUF_MAGIC:
            return _gguf_file(str(p), shown=shown) if deep else Detection(shown, FORMATS["gguf"], weights=str(p))
        if p.parent.is_dir() and p.name in ("config.json", "genai_config.json"):
            return _with_path(detect(p.parent, deep), shown)
        return Detection(shown, FORMATS["not-gguf"], _file_hint(p))
    if not p.is_dir():
        raise FileNotFoundError(f"{shown}: no such file or directory")
    ls = Listing(_names(p), _read_config(p), shown, deep)
    for rule in RULES:
        found = rule(ls)
        if found is not None:
            return found
    return Detection(shown, FORMATS["unknown"])


def _with_path(d: Detection, path: str) -> Detection:
    return Detection(path, d.format, d.detail, d.problem, d.weights)


def _file_hint(p: Path) -> str:
    n = p.name.lower()
    for suffix, what in ((".safetensors", "a safetensors file: kvserve needs its HF folder (config.json, "
                                          "tokenizer)"),
                         (".onnx", "an ONNX graph"), (".bin", "a PyTorch file: kvserve needs its HF folder"),
                         (".engine", "a TensorRT-LLM engine"), (".pth", "a PyTorch checkpoint")):
        if n.endswith(suffix):
            return what
    return ""


def require_loadable(path: str | os.PathLike) -> Detection:
    """:func:`detect` (not deep) then :meth:`Detection.require_loadable`: the check every load
    path runs before the loaders.

    Raises:
        UnsupportedFormatError: a format kvserve does not run (its one-line refusal).
        FileNotFoundError: nothing is at ``path``.
    """
    return detect(path, deep=False).require_loadable()
