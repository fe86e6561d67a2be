"""One loaded encoder model (an embedding or reranking model) and what the faces ask of it.

An :class:`EmbeddingRunner` is the model manager's runner for a model whose task is ``embed``
(BERT-style sentence encoders such as all-MiniLM-L6-v2) or ``score`` (cross-encoders,
``BertForSequenceClassification``), and for a generative model loaded with ``--embeddings``
(llama-server's mode: it then embeds and generates nothing). It holds the
:class:`~kvserve.engine.embedder.EmbeddingEngine` and implements the runner protocol a generative
:class:`~kvserve.serving.chat_runner.Runner` does (:class:`kvserve.serving.runner_protocol.ModelRunner`:
``model_alias``, ``served_names``, ``args``, ``require_ready``, ``close``, ``measured_bytes``,
``needs_reload``, ``device``, ``engine_counts``, ``engine.model_info``, ``engine.n_ctx_slot``...),
so ``/v1/models``, ``/props``, ``/api/ps``, ``/slots``, ``/metrics``, ``/tokenize`` and keep_alive
treat both kinds alike.

Generation is refused: :meth:`EmbeddingRunner.require_generative` (which the chat and completion
planners call first) and ``engine.validate`` raise :class:`~kvserve.errors.NotSupportedError`
naming the model; the runner has a ChatML template only so that a chat request reaches that check.

The faces call :meth:`EmbeddingRunner.embed` and :meth:`EmbeddingRunner.score`. Inputs are
texts or token ids; texts of one request are tokenized together (the ``tokenizers`` batch
encoder) on a worker thread, never on the event loop. Inputs longer than the model's
``n_ctx`` raise :class:`InputTooLongError` (a 400 naming the limit) unless truncation is
asked; an input that is empty after tokenizing raises :class:`~kvserve.errors.InvalidInputError`.

Thread-safety: built on a loader thread, then used on the server's asyncio loop; the engine
runs its forward passes on its own thread.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.errors import InvalidInputError, NotSupportedError, ServerFaultError
from kvserve.models.family import ENCODER_TASKS as FAMILY_ENCODER_TASKS

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.args import ServerArgs
    from kvserve.serving.manager import MemoryEstimate, ModelSpec

log = logging.getLogger("kvserve.server")

#: HF ``architectures`` / GGUF ``general.architecture`` -> task, used when the model registry
#: does not say (it is the authority once it knows the architecture): the encoder families' names
#: and the encoders kvserve has no family for yet (kvserve.models.family).
ENCODER_TASKS = FAMILY_ENCODER_TASKS


class InputTooLongError(InvalidInputError):
    """An input has more tokens than the model takes and truncation was not asked (a 400
    ``exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx``, as llama-server's
    context errors carry them).

    Attributes:
        n_tokens: the input's tokens (special tokens included).
        n_ctx: the most the model takes (tokens).
        index: which input of the request (0-based).
    """

    def __init__(self, n_tokens: int, n_ctx: int, index: int = 0):
        super().__init__(f"input {index} has {n_tokens} tokens, more than this model's maximum context length "
                         f"of {n_ctx} tokens: shorten it or ask for truncation (truncate_prompt_tokens)",
                         "exceed_context_size_error", n_prompt_tokens=n_tokens, n_ctx=n_ctx)
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx
        self.index = index


@dataclass(frozen=True)
class EmbedResult:
    """What :meth:`EmbeddingRunner.embed` returns.

    Attributes:
        vectors: one float32 array per input: ``[dim]`` pooled, or ``[n_tokens, dim]`` with
            pooling ``none``.
        n_tokens: tokens each input ran with (after truncation, special tokens included).
        prompt_ms: wall time of the forward passes, ms.
    """

    vectors: list[np.ndarray]
    n_tokens: list[int]
    prompt_ms: float = 0.0

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class ScoreResult:
    """What :meth:`EmbeddingRunner.score` returns: one score per pair and the tokens each pair
    cost (a cross-encoder's joint input, or both texts' for an embedding model)."""

    scores: list[float]
    n_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


# -- the runner's engine facts ----------------------------------------------------------------

@dataclass
class EncoderStats:
    """Counters ``/metrics`` reads (llama-server's names): prompt tokens and seconds of the
    requests answered, longest input (``n_tokens_max``), and the forward passes run
    (``n_decode_total``: the engine's own count, batches of cancelled requests included)."""

    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    n_tokens_max: int = 0
    prompt_tokens_cached_total: int = 0
    embedder: Any = field(default=None, repr=False)

    @property
    def n_decode_total(self) -> int:
        return int(getattr(self.embedder, "n_forward", 0) or 0)


class EncoderFacts:
    """The ``runner.engine`` of an encoder: the facts faces read of any engine
    (:class:`kvserve.serving.runner_protocol.EngineFacts`: ``model_info``, ``n_ctx``,
    ``n_ctx_slot``, ``n_slots``, ``tokenizer``, ``error``), its ``stats``, its ``device`` and a
    ``validate`` that refuses generation.

    Args:
        embedder: the EmbeddingEngine.
        name: the model's served name (for messages).
        task: ``embed`` or ``score``.
    """

    n_slots = 1

    def __init__(self, embedder: Any, name: str, task: str):
        self.embedder = embedder
        self.tokenizer = embedder.tokenizer
        self.model_info = embedder.model_info
        self.n_ctx = self.n_ctx_slot = int(embedder.n_ctx)
        self.device = str(getattr(embedder, "_device", None) or getattr(embedder, "device", "cpu"))
        self.stats = EncoderStats(embedder=embedder)
        self._name = name
        self._task = task

    @property
    def error(self) -> BaseException | None:
        return getattr(self.embedder, "error", None)

    def validate(self, request: Any = None) -> None:
        """Always raises: an encoder generates no text.

        Raises:
            NotSupportedError: ``model 'x' is an embedding model: ...`` (501).
        """
        raise not_generative(self._name, self._task)

    def shutdown(self) -> None:
        self.embedder.shutdown()


def not_generative(name: str, task: str) -> NotSupportedError:
    """The error a generative request for an encoder gets (501 ``not_supported_error``)."""
    if task == "score":
        return NotSupportedError(f"model '{name}' is a reranking model: it does not generate text "
                                 "(use /rerank or /v1/score)")
    return NotSupportedError(f"model '{name}' is an embedding model: it does not generate text "
                             "(use /v1/embeddings)")


# -- the runner ---------------------------------------------------------------------------

class EmbeddingRunner:
    """One loaded encoder: everything a face reads to serve an embedding or scoring request.

    Attributes:
        spec: the ModelSpec it was loaded for. args: the server's ServerArgs.
        embedder: the EmbeddingEngine (None once closed).
        engine: :class:`EncoderFacts` (None once closed): what faces read of any engine.
        task: ``embed`` (vectors; ``/v1/score`` by cosine similarity) or ``score`` (a
            cross-encoder: a relevance score per (query, document) pair).
        tokenizer, template (ChatML, see the module docstring), slots (one idle slot),
        metrics, model_alias, served_names, model_path, default_params, build_info,
        measured_bytes (resident memory growth of the load, bytes).
        dim: the vector size; n_ctx: the most tokens one input may have.
        matryoshka: the output sizes the model was trained to be cut to (``dimensions``),
            empty when it was not (any size then, or [] for none: see :meth:`check_dimensions`).
    """

    generation = None  # a generative Runner's model defaults: an encoder samples nothing

    def __init__(self, args: ServerArgs, spec: ModelSpec, embedder: Any, build_info: str,
                 measured_bytes: int = 0):
        from kvserve.chat.template import ChatTemplate
        from kvserve.serving.metrics import Metrics
        from kvserve.serving.chat_runner import CHATML
        from kvserve.serving.slots import SlotManager

        self.spec = spec
        self.args = args
        self.embedder = embedder
        self.task = getattr(embedder, "task", "embed") or "embed"
        self.engine: EncoderFacts | None = EncoderFacts(embedder, spec.name, self.task)
        self.tokenizer = embedder.tokenizer
        self.template = ChatTemplate(CHATML, getattr(self.tokenizer, "bos_token", "") or "",
                                     getattr(self.tokenizer, "eos_token", "") or "")
        self.slots = SlotManager(1, self.engine.n_ctx_slot, args.slot_prompt_similarity)
        self.metrics = Metrics(self)
        self.model_alias = spec.name
        self.served_names = spec.served_names()
        self.model_path = spec.path
        self.default_params = args.default_sampling_params()
        self.build_info = build_info
        self.measured_bytes = measured_bytes
        self.dim = int(embedder.dim)
        self.n_ctx = int(embedder.n_ctx)
        self.matryoshka = matryoshka_dimensions(spec.path)
        self._special = _special_frame(self.tokenizer)

    # -- what every runner has

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def device(self) -> str:
        """Where the encoder runs (``cpu``, ``cuda:0``...); ``cpu`` once closed."""
        return self.engine.device if self.engine is not None else "cpu"

    def require_generative(self) -> None:
        """Refuse a generation request (chat, completion, structured outputs...).

        Raises:
            NotSupportedError: ``model 'x' is an embedding model: ...`` (501).
        """
        raise not_generative(self.model_alias, self.task)

    def engine_counts(self) -> tuple[int, int, float]:
        """``(0, 0, 0.0)``: an encoder has no scheduler nor KV cache (its requests count in
        ``metrics``)."""
        return 0, 0, 0.0

    def require_ready(self) -> None:
        """Raise ServerFaultError when the model was unloaded or its engine failed."""
        engine = self.engine
        if engine is None:
            raise ServerFaultError(f"model '{self.model_alias}' was unloaded")
        err = engine.error
        if err is not None:
            raise ServerFaultError(f"the embedding engine failed ({type(err).__name__}) and serves no more "
                                   "requests: restart the server")

    def needs_reload(self, spec: ModelSpec) -> bool:
        """A runner whose engine failed is replaced by a fresh load once idle (unless pinned)."""
        return self.engine is not None and self.engine.error is not None and not self.spec.pinned

    def close(self) -> None:
        """Stop the engine and drop every reference to the model, then return freed heap to the OS."""
        from kvserve.serving.chat_runner import trim_heap

        self.metrics.freeze()  # the counters outlive the runner (kvserve.serving.metrics)
        engine, self.engine, self.embedder = self.engine, None, None
        if engine is not None:
            engine.shutdown()
        self.tokenizer = self.template = self.slots = None
        del engine
        gc.collect()
        trim_heap()

    # -- inputs

    def tokenize(self, inputs: list[str | list[int]], truncate: int | None = None) -> list[list[int]]:
        """Inputs -> token ids with the model's special tokens (worker-thread work: texts go
        through the tokenizer's batch encoder in one call).

        Args:
            inputs: texts, or token-id lists (taken as they are: the caller's special tokens).
            truncate: None: an over-long input raises; k > 0: keep at most k tokens (the
                special tokens at both ends kept); -1: at most ``n_ctx``.

        Raises:
            InputTooLongError: an input over ``n_ctx`` tokens with ``truncate`` None.
            InvalidInputError: ``truncate`` above ``n_ctx`` or 0/below -1; a token id outside
                the vocabulary.
        """
        limit = self.truncation_limit(truncate)
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        out: list[list[int] | None] = [None] * len(inputs)
        if texts:
            encoded = self.tokenizer.encode_batch([t for _, t in texts], add_special=True)
            for (i, _), ids in zip(texts, encoded):
                out[i] = list(ids)
        n_vocab = getattr(self.tokenizer, "n_vocab", None)
        for i, x in enumerate(inputs):
            if out[i] is None:
                ids = list(x)
                bad = next((t for t in ids if n_vocab is not None and not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise InvalidInputError(f"input {i}: token id {bad} is out of range (vocabulary size {n_vocab})")
                out[i] = ids
        return [self._fit(ids, i, limit, isinstance(inputs[i], str)) for i, ids in enumerate(out)]  # type: ignore[arg-type]

    def truncation_limit(self, truncate: int | None) -> int | None:
        """The token limit a ``truncate`` value means (None: no truncation).

        Raises:
            InvalidInputError: a value above ``n_ctx``, 0, or below -1.
        """
        if truncate is None:
            return None
        if truncate == -1:
            return self.n_ctx
        if truncate < 1:
            raise InvalidInputError("truncate_prompt_tokens must be -1 (the model's maximum) or at least 1")
        if truncate > self.n_ctx:
            raise InvalidInputError(f"truncate_prompt_tokens value ({truncate}) is greater than the model's "
                                    f"maximum context length ({self.n_ctx}); select a smaller truncation size")
        return truncate

    def _fit(self, ids: list[int], index: int, limit: int | None, framed: bool) -> list[int]:
        if limit is None:
            if len(ids) > self.n_ctx:
                raise InputTooLongError(len(ids), self.n_ctx, index)
            return ids
        if len(ids) <= limit:
            return ids
        head, tail = self._special if framed else (0, 0)
        if limit <= head + tail:
            return ids[:limit]
        return ids[:limit - tail] + ids[len(ids) - tail:] if tail else ids[:limit]

    # -- running

    async def embed(self, inputs: list[str | list[int]], *, truncate: int | None = None,
                    pooling: str | None = None, normalize: int | None = None) -> EmbedResult:
        """Vectors for ``inputs`` (see :meth:`tokenize` for inputs and ``truncate``).

        Args:
            pooling: ``none``/``mean``/``cls``/``last`` for this request (None: the model's).
            normalize: llama-server's ``embd_normalize`` (-1 none, 0 max-abs int16, 1 taxicab,
                2 Euclidean, >2 p-norm); None: the model's own (its Normalize module, else the
                server's ``--embd-normalize``).

        Raises:
            InputTooLongError, InvalidInputError: see :meth:`tokenize`; an input with no
            tokens. ServerFaultError: the model was unloaded or its engine failed.
        """
        self.require_ready()
        ids = await asyncio.to_thread(self.tokenize, inputs, truncate)
        return await self.embed_ids(ids, pooling=pooling, normalize=normalize)

    async def embed_ids(self, ids: list[list[int]], *, pooling: str | None = None,
                        normalize: int | None = None) -> EmbedResult:
        """Vectors for inputs already tokenized and fitted (by :meth:`tokenize`)."""
        self.require_ready()
        empty = next((i for i, x in enumerate(ids) if not x), None)
        if empty is not None:
            raise InvalidInputError(f"input {empty} is empty: it has no tokens to embed")
        t0 = time.perf_counter()
        vectors = await self.embedder.embed(ids, pooling=pooling, normalize=normalize) if ids else []
        ms = (time.perf_counter() - t0) * 1e3
        self._count(ids, ms)
        return EmbedResult([np.asarray(v, dtype=np.float32) for v in vectors], [len(x) for x in ids], ms)

    async def score(self, pairs: list[tuple[str, str]], *, truncate: int | None = None) -> ScoreResult:
        """One relevance score per (query, document) pair.

        A cross-encoder (task ``score``) scores each pair jointly (the engine's raw output,
        a logit for a one-label classifier); an embedding model answers with the cosine
        similarity of the two texts' vectors, as vLLM does.

        Raises:
            InputTooLongError / InvalidInputError: as :meth:`embed`. ServerFaultError: as :meth:`embed`.
        """
        self.require_ready()
        if not pairs:
            return ScoreResult([], [])
        if self.task != "score":
            return await self._cosine(pairs, truncate)
        limit = self.truncation_limit(truncate)
        joint = await asyncio.to_thread(self._pair_ids, pairs, limit)
        t0 = time.perf_counter()
        scores = await self.embedder.score(joint)
        self._count([q + d for q, d in joint], (time.perf_counter() - t0) * 1e3)
        n_tokens = [len(q) + len(d) + sum(self._special) + 1 for q, d in joint]  # [CLS] q [SEP] d [SEP]
        return ScoreResult([float(s) for s in scores], n_tokens)

    def _pair_ids(self, pairs: list[tuple[str, str]], limit: int | None) -> list[tuple[list[int], list[int]]]:
        """(query ids, document ids) per pair without special tokens; the joint input
        ([CLS] q [SEP] d [SEP]) must fit ``n_ctx`` (the document is cut first when truncating)."""
        tok = self.tokenizer
        qs = tok.encode_batch([q for q, _ in pairs], add_special=False)
        ds = tok.encode_batch([d for _, d in pairs], add_special=False)
        room = (limit or self.n_ctx) - sum(self._special) - 1  # the separator between the two
        out = []
        for i, (q, d) in enumerate(zip(qs, ds)):
            q, d = list(q), list(d)
            if len(q) + len(d) > room:
                if limit is None:
                    raise InputTooLongError(len(q) + len(d) + sum(self._special) + 1, self.n_ctx, i)
                d = d[:max(room - len(q), 0)]
                q = q[:room - len(d)]
            out.append((q, d))
        return out

    async def _cosine(self, pairs: list[tuple[str, str]], truncate: int | None) -> ScoreResult:
        texts = [t for pair in pairs for t in pair]
        res = await self.embed(texts, truncate=truncate, normalize=2)
        scores = []
        for k in range(len(pairs)):
            a, b = res.vectors[2 * k], res.vectors[2 * k + 1]
            denom = float(np.linalg.norm(a) * np.linalg.norm(b))
            scores.append(float(np.dot(a, b)) / denom if denom > 0 else 0.0)
        return ScoreResult(scores, [res.n_tokens[2 * k] + res.n_tokens[2 * k + 1] for k in range(len(pairs))])

    def _count(self, ids: list[list[int]], ms: float) -> None:
        st = self.engine.stats if self.engine is not None else None
        if st is None:
            return
        st.prompt_tokens_total += sum(len(x) for x in ids)
        st.prompt_seconds_total += ms / 1e3
        st.n_tokens_max = max([st.n_tokens_max, *(len(x) for x in ids)])

    # -- output size

    def check_dimensions(self, dimensions: int | None) -> int | None:
        """The output size a request's ``dimensions`` asks for (None: the model's own).

        Matryoshka rule (vLLM's): a size other than the model's is allowed only for a model
        trained to be cut (``matryoshka_dimensions`` or ``is_matryoshka`` in its config.json);
        the vector is then cut to its first ``dimensions`` values and normalized again.

        Raises:
            InvalidInputError: a size below 1, above the model's, or any other size for a
                model without Matryoshka training.
        """
        if dimensions is None or dimensions == self.dim:
            return None
        if dimensions < 1:
            raise InvalidInputError("dimensions must be at least 1")
        if dimensions > self.dim:
            raise InvalidInputError(f"dimensions ({dimensions}) is larger than the model's embedding size "
                                    f"({self.dim})")
        if self.matryoshka is None:
            raise InvalidInputError(f"model '{self.model_alias}' does not support matryoshka representation: its "
                                    f"vectors have {self.dim} dimensions, and cutting them would give poor results")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise InvalidInputError(f"model '{self.model_alias}' supports dimensions {self.matryoshka}, "
                                    f"not {dimensions}")
        return dimensions


def cut_dimensions(vectors: list[np.ndarray], dimensions: int | None) -> list[np.ndarray]:
    """Each vector's first ``dimensions`` values, normalized to unit length again (Ollama's and
    vLLM's Matryoshka cut); the vectors unchanged when ``dimensions`` is None."""
    if dimensions is None:
        return vectors
    out = []
    for v in vectors:
        w = np.ascontiguousarray(v[..., :dimensions], dtype=np.float32)
        norm = float(np.linalg.norm(w))
        out.append(w / max(norm, 1e-12))
    return out


def _special_frame(tokenizer: Any) -> tuple[int, int]:
    """(tokens before, tokens after) the text that ``encode(add_special=True)`` adds: (1, 1)
    for BERT's ``[CLS] ... [SEP]``, (1, 0) for a BOS-only decoder."""
    try:
        bare = tokenizer.encode("a", add_special=False)
        full = tokenizer.encode("a", add_special=True)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: no frame
        return (0, 0)
    for head in range(len(full) - len(bare) + 1):
        if full[head:head + len(bare)] == bare:
            return head, len(full) - len(bare) - head
    return (0, 0)


def matryoshka_dimensions(path: str) -> list[int] | None:
    """The sizes an HF model's config.json says it may be cut to: ``matryoshka_dimensions``
    (a list), ``[]`` for ``is_matryoshka: true`` (any size), None when neither is set."""
    cfg = _hf_config(path)
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return sorted(dims)
    return [] if cfg.get("is_matryoshka") is True else None


def _hf_config(path: str) -> dict:
    p = Path(path) / "config.json" if path else None
    if p is None or not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# -- which models are encoders ------------------------------------------------------------------

def architectures(path: str) -> list[str]:
    """The architecture names of a model from its header only: an HF directory's config.json
    ``architectures`` (and ``model_type``), a GGUF's ``general.architecture``; [] if unreadable."""
    p = Path(path)
    if p.is_dir():
        cfg = _hf_config(path)
        names = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
        if isinstance(cfg.get("model_type"), str):
            names.append(cfg["model_type"])
        return names
    try:
        from kvserve.loaders.tokenizer import read_gguf_metadata

        arch = read_gguf_metadata(p).get("general.architecture")
    except Exception:  # noqa: BLE001 - not a readable GGUF: not an encoder we know
        return []
    return [str(arch)] if arch else []


_TASKS: dict[tuple[str, int, int], str] = {}


def _task_key(path: str) -> tuple[str, int, int] | None:
    p = Path(path)
    try:
        st = (p / "config.json").stat() if p.is_dir() else p.stat()
    except OSError:
        return None
    return (path, st.st_mtime_ns, st.st_size)


def cached_task(path: str) -> str | None:
    """:func:`model_task`'s answer for ``path`` when it is known for the file as it is now (a
    stat, no read: cheap enough for the event loop), else None."""
    key = _task_key(path) if path else None
    return _TASKS.get(key) if key is not None else None


def model_task(path: str) -> str:
    """``generate``, ``embed`` or ``score`` for the model at ``path``, from its header only: the
    model registry's answer (``kvserve.models.build.probe_task``), else
    :data:`ENCODER_TASKS` over :func:`architectures`, else ``generate`` (a file that cannot be
    read is left for the loader to report). Remembered per file (path, mtime, size)."""
    if not path:
        return "generate"
    key = _task_key(path)
    if key is not None and key in _TASKS:
        return _TASKS[key]
    task = _probe(path)
    if key is not None:
        if len(_TASKS) > 1024:
            _TASKS.clear()
        _TASKS[key] = task
    return task


def _probe(path: str) -> str:
    try:
        from kvserve.models.build import probe_task
    except ImportError:
        probe_task = None
    if probe_task is not None:
        try:
            task = probe_task(path)
        except Exception:  # noqa: BLE001 - unreadable: the heuristics below, then the loader's error
            task = None
        if task in ("generate", "embed", "score"):
            return task
    for name in architectures(path):
        if name in ENCODER_TASKS:
            return ENCODER_TASKS[name]
    return "generate"


def hf_header(path: str) -> dict[str, Any]:
    """An HF directory's config.json as the GGUF-style keys Ollama's /api/show lists
    (``general.architecture``, ``<arch>.block_count``, ``.context_length``, ``.embedding_length``,
    ``.feed_forward_length``, ``.attention.head_count``, ``general.parameter_count`` from the
    safetensors headers); keys the config lacks are left out."""
    cfg = _hf_config(path)
    arch = str(cfg.get("model_type") or "")
    md: dict[str, Any] = {"general.architecture": arch} if arch else {}
    for key, name in (("num_hidden_layers", "block_count"), ("max_position_embeddings", "context_length"),
                      ("hidden_size", "embedding_length"), ("intermediate_size", "feed_forward_length"),
                      ("num_attention_heads", "attention.head_count")):
        if isinstance(cfg.get(key), int) and arch:
            md[f"{arch}.{name}"] = cfg[key]
    md["general.parameter_count"] = sum(_safetensors_params(f) for f in sorted(Path(path).glob("*.safetensors")))
    return md


def is_embedding_runner(runner: Any) -> bool:
    """True for a runner that embeds (an :class:`EmbeddingRunner`)."""
    return isinstance(runner, EmbeddingRunner)


# -- loading and sizing --------------------------------------------------------------------------

def load_embedding_runner(args: ServerArgs, spec: ModelSpec, build_info: str) -> EmbeddingRunner:
    """Load ``spec`` as an encoder (the model manager's loader for embed/score models, and for
    every model with ``--embeddings``). Logs llama-server's ``loading model`` line.

    Raises:
        ModelLoadError / FileNotFoundError: the files are bad or the architecture unknown.
    """
    from kvserve.engine.embedder import EmbeddingEngine
    from kvserve.models.build import load_files
    from kvserve.serving.chat_runner import engine_config, rss_bytes

    before = rss_bytes()
    log.info("loading model '%s'", spec.path, extra={"func": "load_model"})
    cfg = engine_config(args, spec)
    pooling = getattr(args, "pooling", None) or None
    normalize = getattr(args, "embd_normalize", None)
    embedder = EmbeddingEngine(load_files(spec.path), cfg, pooling=pooling, normalize=normalize)
    log.info("initializing encoder, task = %s, n_ctx = %d, n_embd = %d, pooling = %s", embedder.task,
             embedder.n_ctx, embedder.dim, embedder.pooling, extra={"func": "load_model"})
    return EmbeddingRunner(args, spec, embedder, build_info, max(rss_bytes() - before, 0))


def estimate_encoder_memory(args: ServerArgs, spec: ModelSpec) -> MemoryEstimate:
    """Predict an encoder's memory before it loads: the weights as they will be held (float32
    from the file's parameters: safetensors tensors or GGUF elements, x 4 bytes) plus one
    batch's activations (``--max-num-batched-tokens`` tokens, float32, with the attention
    scores of ``heads x n_ctx`` per token); no KV cache.

    Raises:
        OSError / ModelLoadError: the header cannot be read.
    """
    from kvserve.serving.manager import estimate_memory
    from kvserve.serving.chat_runner import engine_config

    n_params, hidden, n_heads, n_ctx, n_ff = _encoder_shape(spec.path)
    cfg = engine_config(args, spec)
    n_tok = max(min(cfg.max_num_batched_tokens or 2048, 8192), n_ctx)
    compute = 4 * n_tok * (8 * hidden + 2 * n_ff + n_heads * n_ctx)
    return estimate_memory(n_params * 4, 0, 0, 0, 0, compute_bytes=compute)


def _encoder_shape(path: str) -> tuple[int, int, int, int, int]:
    """(parameters, hidden size, heads, max positions, feed-forward size) from the header."""
    p = Path(path)
    if p.is_dir():
        cfg = _hf_config(path)
        n_params = sum(_safetensors_params(f) for f in sorted(p.glob("*.safetensors")))
        return (n_params, int(cfg.get("hidden_size", 768)), int(cfg.get("num_attention_heads", 12)),
                int(cfg.get("max_position_embeddings", 512)), int(cfg.get("intermediate_size", 3072)))
    from kvserve.loaders.gguf import read_gguf_header

    md, tensors = read_gguf_header(str(p))
    arch = str(md.get("general.architecture") or "bert")

    def get(key: str, default: int) -> int:
        v = md.get(f"{arch}.{key}")
        return int(v) if isinstance(v, (int, float)) else default

    return (sum(t.n_elements for t in tensors), get("embedding_length", 768), get("attention.head_count", 12),
            get("context_length", 512), get("feed_forward_length", 3072))


def _safetensors_params(path: Path) -> int:
    with open(path, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        if hlen > 100 << 20:
            return 0
        header = json.loads(fh.read(hlen))
    n = 0
    for k, v in header.items():
        if k != "__metadata__" and isinstance(v, dict):
            n += math.prod(int(d) for d in v.get("shape", []))
    return n


__all__ = [
    "ENCODER_TASKS",
    "EmbedResult",
    "EmbeddingRunner",
    "EncoderFacts",
    "EncoderStats",
    "InputTooLongError",
    "ScoreResult",
    "architectures",
    "cached_task",
    "cut_dimensions",
    "estimate_encoder_memory",
    "hf_header",
    "is_embedding_runner",
    "load_embedding_runner",
    "matryoshka_dimensions",
    "model_task",
    "not_generative",
]
