"""What a face may ask of a loaded model: the runner protocol.

Two kinds of runner implement it: :class:`kvserve.serving.chat_runner.Runner` (a generative model, its
engine on its own thread) and :class:`kvserve.serving.embed_runner.EmbeddingRunner` (an encoder:
embeddings and scores). A face holds either through the model manager
(:func:`kvserve.faces.models.serve_model`) and reads only what is declared here; what only one
kind has (a Runner's ``grammars`` and engine calls, an EmbeddingRunner's ``embed``) is read after
the face knows which kind it holds: :meth:`ModelRunner.require_generative` for generation, an
``isinstance`` check for embeddings.

Thread-safety: every member is read on the event loop; ``engine_counts`` reads the engine thread's
containers without a lock (a step out of date at worst).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineFacts", "ModelRunner"]


@runtime_checkable
class EngineFacts(Protocol):
    """``runner.engine``: the facts faces read of any engine.

    Attributes:
        model_info: the loaded file's :class:`kvserve.loaders.weights.ModelInfo` (``/props``,
            ``/v1/models``' ``meta``, ``/api/show``).
        n_ctx: KV context of the whole engine, tokens. n_ctx_slot: one sequence's, tokens.
        n_slots: sequences served at once.
        tokenizer: the model's Tokenizer.
        error: the exception that killed the engine, or None while it serves.
    """

    model_info: Any
    tokenizer: Any

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_ctx_slot(self) -> int: ...

    @property
    def n_slots(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...


@runtime_checkable
class ModelRunner(Protocol):
    """One loaded model as a face sees it.

    Attributes:
        spec: the ModelSpec it was loaded for. args: the server's ServerArgs.
        engine: its :class:`EngineFacts` (None once closed).
        task: ``generate`` (a chat/completion model), ``embed`` or ``score`` (encoders).
        tokenizer, template (a ChatTemplate), slots (the SlotManager ``/slots`` shows),
        metrics (its ``/metrics`` window), model_alias (the name responses show), served_names,
        model_path, default_params (SamplingParams), generation (the model's own defaults with
        their sources, None for an encoder), build_info, measured_bytes (resident bytes it took).
    """

    spec: Any
    args: Any
    engine: Any
    task: str
    tokenizer: Any
    template: Any
    slots: Any
    metrics: Any
    model_alias: str
    served_names: list[str]
    model_path: str
    default_params: Any
    generation: Any
    build_info: str
    measured_bytes: int

    @property
    def ready(self) -> bool:
        """False once closed."""
        ...

    @property
    def device(self) -> str:
        """Where its weights run (``cpu``, ``cuda:0``...)."""
        ...

    def require_ready(self) -> None:
        """Raise ServerFaultError when it was unloaded or its engine failed."""
        ...

    def require_generative(self) -> None:
        """Raise NotSupportedError (501) when it generates no text (an encoder)."""
        ...

    def engine_counts(self) -> tuple[int, int, float]:
        """``(running, queued, kv usage 0..1)`` in its engine now (an encoder: ``(0, 0, 0.0)``)."""
        ...

    def needs_reload(self, spec: Any) -> bool:
        """Whether a request for ``spec`` needs a fresh load (its engine failed)."""
        ...

    def close(self) -> None:
        """Stop its engine and free the model (a worker thread runs it)."""
        ...
