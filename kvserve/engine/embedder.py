"""EmbeddingEngine: an encoder (or a decoder used for its hidden states) on its own thread.

The encoder path of the engine: no KV cache, no sampler, no slots. A call hands over whole
inputs (token ids); the worker thread sorts them by length, cuts them into batches of at most
``max_num_batched_tokens`` padded tokens (at least one input each), runs one forward pass per
batch and pools and normalizes the vectors. Calls that wait while a batch runs are taken
together by the next round, so concurrent small requests share forward passes. The event loop
never runs the model: a call awaits a future the worker resolves.

Models: BERT encoders (:class:`kvserve.models.bert.BertModel`, task "embed", or "score" with a
classifier head) and llama-family decoders (task "embed" over the final normalized hidden
states, as llama-server's ``--embeddings --pooling last|mean`` does with a generative GGUF; one
packed forward per batch with causal attention inside each input, positions from 0).

Thread-safety: every public method may be called from any thread or loop; the model is only
touched by the worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.pooling import check_normalize, check_pooling, normalize as normalize_vec, pool
from kvserve.engine.request import ContextSizeExceededError
from kvserve.errors import InvalidInputError, NotSupportedError

log = logging.getLogger("kvserve.embedder")

#: llama-server's text for an empty input
EMPTY_INPUT = "Input content cannot be empty"


@dataclass(slots=True)
class _Job:
    """One call: inputs (ids, token types), what to return, and the future the caller awaits.
    ``cancelled`` is set by the caller's side when its task is cancelled; the worker reads it
    between forward passes."""

    kind: str  # "embed" | "score"
    inputs: list[tuple[list[int], list[int] | None]]
    pooling: str
    normalize: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)


class EmbeddingEngine:
    """An encoder model behind one worker thread; whole inputs, batched, one forward pass per batch.

    Args:
        loaded: a LoadedModel (``kvserve.models.build.load_files``) of a BERT encoder or a
            llama-family decoder.
        config: EngineConfig: ``n_ctx`` (0 = the model's positions; never above them),
            ``max_model_len``, ``max_num_batched_tokens`` (padded tokens per forward pass; at
            least one whole input always runs), ``threads``, ``device``.
        pooling: explicit pooling (llama-server ``--pooling``: none, mean, cls, last); None =
            the model's own (sentence-transformers 1_Pooling, GGUF ``bert.pooling_type``), else
            "mean" for encoders and "last" for decoders.
        normalize: explicit ``--embd-normalize``; None = the model's own (2 with a
            sentence-transformers Normalize module, -1 with a modules.json without one), else 2
            (llama-server's default).

    Attributes:
        tokenizer: the model's kvserve Tokenizer.
        model_info: ModelInfo (format, arch, n_params, size, n_embd, ...).
        task: "embed", or "score" for a cross-encoder (BertForSequenceClassification).
        n_ctx: longest input in tokens.
        dim: vector size (n_embd).
        pooling, normalize: the defaults :meth:`embed` uses.
        error: the exception that killed the worker, or None.
        n_forward: forward passes run since start (llama-server's ``n_decode_total``; written
            by the worker thread only).
        n_inputs_cancelled: inputs never run because their call was cancelled (worker only).

    Raises:
        ModelLoadError (from the registry): not an architecture that can embed.
        InvalidInputError: an unknown pooling mode or normalize value.
    """

    def __init__(self, loaded, config: EngineConfig, *, pooling: str | None = None, normalize: int | None = None):
        from kvserve.models.bert import BertConfig
        from kvserve.models.build import build_embedding_model

        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        mc = loaded.config
        self._encoder = isinstance(mc, BertConfig)
        self.task: str = mc.task if self._encoder else "embed"
        n_pos = mc.n_ctx_train
        n_ctx = min(config.n_ctx or n_pos, n_pos) if self._encoder else (config.n_ctx or n_pos)
        if config.max_model_len:
            n_ctx = min(n_ctx, config.max_model_len)
        self.n_ctx: int = n_ctx
        self.dim: int = mc.n_embd
        own_pooling = getattr(mc, "pooling", None)
        if own_pooling == "rank":
            own_pooling = None
        self.pooling: str = check_pooling(pooling or own_pooling or ("mean" if self._encoder else "last"))
        own_norm = getattr(mc, "normalize", None)
        self.normalize: int = check_normalize(normalize if normalize is not None else
                                              (own_norm if own_norm is not None else 2))
        self._budget = max(config.max_num_batched_tokens, 1)
        self._pad_id = int(getattr(mc, "pad_token_id", 0) or 0)
        self._sep_id = getattr(self.tokenizer, "eos_token_id", None)
        self._cls_id = getattr(self.tokenizer, "bos_token_id", None)
        config.apply_threads()
        self._model = build_embedding_model(loaded, config, n_ctx)
        self._device = self._model.device
        self.error: BaseException | None = None
        self.n_forward = 0
        self.n_inputs_cancelled = 0
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvserve-embedder", daemon=True)
        self._thread.start()

    # -- API ------------------------------------------------------------------------

    async def embed(self, inputs: list[list[int]], *, pooling: str | None = None,
                    normalize: int | None = None) -> list[np.ndarray]:
        """Vectors of whole inputs.

        Args:
            inputs: token ids per input, special tokens included (``tokenizer.encode(text,
                add_special=True)``); every input runs whole, never truncated here.
            pooling: this call's pooling (default :attr:`pooling`).
            normalize: this call's ``--embd-normalize`` (default :attr:`normalize`); pooling
                "none" is never normalized (llama-server).

        Returns:
            per input, in order: float32 [dim], or [n_tokens, dim] with pooling "none".

        Raises:
            InvalidInputError: an empty input (llama-server's "Input content cannot be empty"),
                a token id outside the vocabulary, an unknown pooling/normalize;
                ContextSizeExceededError (an InvalidInputError with ``n_prompt_tokens`` and
                ``n_ctx``): an input longer than :attr:`n_ctx`.
            EngineDeadError: after :meth:`shutdown` or when the worker died.
            asyncio.CancelledError: the awaiting task was cancelled; the inputs not yet run
                are dropped (see the module docstring).
        """
        mode = check_pooling(pooling or self.pooling)
        norm = check_normalize(normalize if normalize is not None else self.normalize)
        for ids in inputs:
            self._check(ids)
        return await self._submit(_Job("embed", [(list(ids), None) for ids in inputs], mode, norm))

    async def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        """Cross-encoder relevance of (query, document) pairs, llama-server's rerank score.

        Args:
            pairs: (query ids, document ids) per pair, each tokenized WITHOUT special tokens
                (``tokenizer.encode(text)``); the engine runs ``[CLS] q [SEP] d [SEP]`` with
                token types 0 for ``[CLS] q [SEP]`` and 1 for ``d [SEP]`` (see :meth:`pair_ids`).

        Returns:
            per pair, in order: the classifier's first logit (raw, no sigmoid), as llama-server's
            ``/rerank`` ``relevance_score``.

        Raises:
            NotSupportedError: the model has no classifier (task "embed"; score embeddings by
                cosine instead, as vLLM does).
            InvalidInputError / ContextSizeExceededError: as :meth:`embed`, for the joined pair.
            EngineDeadError: after :meth:`shutdown` or when the worker died.
        """
        if self.task != "score":
            raise NotSupportedError("this model has no classifier head: it embeds, it does not score pairs")
        inputs = [self.pair_ids(q, d) for q, d in pairs]
        for ids, _ in inputs:
            self._check(ids)
        return await self._submit(_Job("score", inputs, "cls", -1))

    def pair_ids(self, query: list[int], doc: list[int]) -> tuple[list[int], list[int]]:
        """``([CLS] q [SEP] d [SEP], token types)`` for raw query/document ids (no special tokens)."""
        cls = [self._cls_id] if self._cls_id is not None else []
        sep = [self._sep_id] if self._sep_id is not None else []
        first = cls + list(query) + sep
        second = list(doc) + sep
        return first + second, [0] * len(first) + [1] * len(second)

    def encode_pair(self, query: str, doc: str) -> list[int]:
        """Token ids of ``[CLS] query [SEP] doc [SEP]``: what :meth:`score` runs for these texts
        (usage counting; the token types follow from the first ``[SEP]``)."""
        tok = self.tokenizer
        return self.pair_ids(tok.encode(query), tok.encode(doc))[0]

    def shutdown(self) -> None:
        """Stop the worker (joined), fail waiting calls with EngineDeadError and drop the model.

        Idempotent. After it, the model's tensors are no longer referenced from here.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._inbox.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._fail_pending(EngineDeadError("the embedding engine was shut down"))
        self._model = None
        self.tokenizer = None

    # -- caller side ----------------------------------------------------------------

    def _check(self, ids: list[int]) -> None:
        if len(ids) == 0:
            raise InvalidInputError(EMPTY_INPUT)
        if len(ids) > self.n_ctx:
            raise ContextSizeExceededError(len(ids), self.n_ctx)
        n_vocab = self.model_info.n_vocab
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= n_vocab:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(f"token id {bad} out of range [0, {n_vocab})")

    async def _submit(self, job: _Job):
        if not job.inputs:
            return []
        with self._lock:
            if self._stopped or self.error is not None:
                raise EngineDeadError(f"the embedding engine is not running{self._cause()}")
            self._inbox.put(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancelled.set()  # the worker drops what it has not run (a waiting job never starts)
            raise

    def _cause(self) -> str:
        return f": {self.error}" if self.error is not None else ""

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None and not job.future.done():
                job.future.set_exception(exc)

    # -- worker ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                job = self._inbox.get()
                if job is None:
                    return
                jobs = [job]
                while True:  # take every call already waiting: they share forward passes
                    try:
                        nxt = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._inbox.put(None)
                        break
                    jobs.append(nxt)
                try:
                    self._round(jobs)
                except Exception as e:  # noqa: BLE001 - this round's calls fail, the worker goes on
                    log.exception("embedding round failed")
                    for j in jobs:
                        if not j.future.done():
                            j.future.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - the worker must report, not vanish
            log.exception("embedding worker died")
            self.error = e
            self._fail_pending(EngineDeadError(f"the embedding engine failed: {e}"))

    def _round(self, jobs: list[_Job]) -> None:
        """Run the inputs of ``jobs`` in length-sorted batches; resolve each job's future."""
        started = [j.future.set_running_or_notify_cancel() for j in jobs]  # False: cancelled while waiting
        self.n_inputs_cancelled += sum(len(j.inputs) for j, ok in zip(jobs, started) if not ok)
        jobs = [j for j, ok in zip(jobs, started) if ok]
        groups: dict[tuple, list[tuple[int, int]]] = {}  # (kind, pooling) -> (job index, input index)
        for ji, job in enumerate(jobs):
            key = (job.kind, job.pooling)
            groups.setdefault(key, []).extend((ji, ii) for ii in range(len(job.inputs)))
        results: list[list] = [[None] * len(j.inputs) for j in jobs]
        failed: dict[int, BaseException] = {}
        for (kind, mode), items in groups.items():
            items.sort(key=lambda t: len(jobs[t[0]].inputs[t[1]][0]))
            for batch in self._batches(items, jobs):
                batch = self._live(batch, jobs)
                if not batch:
                    continue
                try:
                    outs = self._forward([jobs[ji].inputs[ii] for ji, ii in batch], kind, mode)
                except Exception as e:  # noqa: BLE001 - fails the calls of this batch only
                    log.exception("embedding batch failed")
                    for ji, _ in batch:
                        failed.setdefault(ji, e)
                    continue
                finally:
                    self.n_forward += 1
                for (ji, ii), out in zip(batch, outs):
                    results[ji][ii] = out
        for ji, job in enumerate(jobs):
            if job.cancelled.is_set():  # nobody awaits it: resolved only so that nothing hangs on it
                job.future.set_exception(asyncio.CancelledError())
            elif ji in failed:
                job.future.set_exception(failed[ji])
            elif job.kind == "score":
                job.future.set_result([float(x) for x in results[ji]])
            else:
                norm = job.normalize if job.pooling != "none" else -1
                job.future.set_result([normalize_vec(v, norm) if norm != -1 else v for v in results[ji]])

    def _live(self, batch: list[tuple[int, int]], jobs: list[_Job]) -> list[tuple[int, int]]:
        """``batch`` less the inputs of jobs cancelled by now (counted in :attr:`n_inputs_cancelled`)."""
        live = [it for it in batch if not jobs[it[0]].cancelled.is_set()]
        self.n_inputs_cancelled += len(batch) - len(live)
        return live

    def _batches(self, items: list[tuple[int, int]], jobs: list[_Job]):
        """Cut length-sorted items into runs of at most ``_budget`` padded tokens (one at least).
        Lazy, so that :meth:`_live` sees each batch just before it runs."""
        batch: list[tuple[int, int]] = []
        for it in items:
            n = len(jobs[it[0]].inputs[it[1]][0])
            if batch and n * (len(batch) + 1) > self._budget:
                yield batch
                batch = []
            batch.append(it)
        if batch:
            yield batch

    def _forward(self, inputs: list[tuple[list[int], list[int] | None]], kind: str, mode: str) -> list:
        """One forward pass -> per input: float32 numpy vector(s), or a float score."""
        if self._encoder:
            return self._forward_encoder(inputs, kind, mode)
        return self._forward_decoder([ids for ids, _ in inputs], mode)

    def _forward_encoder(self, inputs, kind: str, mode: str) -> list:
        lengths = [len(ids) for ids, _ in inputs]
        B, L = len(inputs), max(lengths)
        ids = np.full((B, L), self._pad_id, dtype=np.int64)
        types = np.zeros((B, L), dtype=np.int64)
        for b, (x, t) in enumerate(inputs):
            ids[b, :len(x)] = x
            if t is not None:
                types[b, :len(t)] = t
        dev = self._device
        mask = torch.from_numpy(np.arange(L)[None, :] < np.asarray(lengths)[:, None]).to(dev)  # [B, L]
        hidden = self._model.forward(torch.from_numpy(ids).to(dev), torch.from_numpy(types).to(dev), mask)
        if kind == "score":
            logits = self._model.classify(hidden[:, 0])  # [B, n_labels]
            return logits[:, 0].float().cpu().tolist()
        return [v.float().cpu().numpy() for v in pool(hidden, lengths, mode)]

    def _forward_decoder(self, seqs: list[list[int]], mode: str) -> list:
        from kvserve.models.llama import AttentionBatch, PrefillGroup

        m = self._model
        c = m.config
        dev = self._device
        lengths = [len(s) for s in seqs]
        T = sum(lengths)
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        groups, start = [], 0
        for n in lengths:
            groups.append(PrefillGroup(start, start + n, 0))  # causal over the input's own tokens
            start += n
        batch = AttentionBatch(positions=positions, slot_mapping=torch.arange(T, device=dev), prefills=groups)
        # a scratch KV of exactly these rows, float32 so nothing is rounded
        kv = [(torch.empty(T, c.n_head_kv, c.head_dim, device=dev), torch.empty(T, c.n_head_kv, c.head_dim, device=dev))
              for _ in range(c.n_layer)]
        hidden = m.forward(flat, batch, kv, None, return_hidden=True).float()  # [T, E]
        del kv
        out, start = [], 0
        for n in lengths:
            h = hidden[start:start + n].unsqueeze(0)  # [1, n, E]
            out.append(pool(h, [n], mode)[0].cpu().numpy())
            start += n
        return out
