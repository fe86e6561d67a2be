"""Per-process server state and the one path every face uses to run a request.

``ServerState`` holds what the faces need (engine, tokenizer, chat template,
slots, metrics, names); ``generate`` places a request in a slot, runs it on the
engine and keeps the slot's view current.

Thread-safety: the state is written by the loader thread once (``set_loaded``)
and otherwise read and changed only on the server's asyncio loop.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.engine.request import Request, RequestOutput, SamplingParams
from kvserve.faces.errors import ApiError
from kvserve.serving.metrics import Metrics
from kvserve.serving.slots import SlotManager
from kvserve.structured.backend import GrammarBackend

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.chat.template import ChatTemplate
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.serving.args import ServerArgs


def build_info() -> str:
    """``b<commits>-<sha7>`` from the source checkout's git, else ``kvserve-<version>``."""
    root = Path(__file__).resolve().parents[2]
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()

        return f"b{git('rev-list', '--count', 'HEAD')}-{git('rev-parse', '--short=7', 'HEAD')}"
    except (OSError, subprocess.SubprocessError):
        try:
            from importlib.metadata import version

            return f"kvserve-{version('kvserve')}"
        except Exception:  # noqa: BLE001 - metadata missing in odd installs
            return "kvserve-0"


class ServerState:
    """Everything one server process shares between requests.

    Attributes:
        args: the parsed command line (ServerArgs).
        engine: the AsyncEngine, None while the model loads.
        tokenizer: the model's Tokenizer (None while loading).
        template: the ChatTemplate (None while loading or when the model has none).
        slots: the SlotManager (None while loading).
        metrics: the Metrics window for ``/metrics``.
        build_info: ``b<N>-<sha7>`` or ``kvserve-<version>``.
        model_alias: first served name (``-a``/``--served-model-name``, else the model spec).
        served_names: every name the model answers to.
        model_path: resolved model file/directory ("" while loading).
        default_params: server-wide SamplingParams defaults (``--temp``, ``-n``...).
        load_error: message when loading failed (the server then answers 503/500).
        grammars: the model's GrammarBackend (structured outputs: compile cache and
            per-request constraints), None while loading; xgrammar itself loads on the
            first constrained request.
    """

    def __init__(self, args: "ServerArgs"):
        self.args = args
        self.engine: AsyncEngine | None = None
        self.tokenizer = None
        self.template: ChatTemplate | None = None
        self.slots: SlotManager | None = None
        self.metrics = Metrics(self)
        self.build_info = build_info()
        self.served_names: list[str] = list(args.served_names())
        self.model_alias: str = self.served_names[0]
        self.model_path: str = ""
        self.default_params: SamplingParams = args.default_sampling_params()
        self.load_error: str | None = None
        self.grammars: GrammarBackend | None = None

    def set_loaded(self, engine: "AsyncEngine", template: "ChatTemplate | None", model_path: str) -> None:
        """Publish the loaded engine (called once, by the loader)."""
        self.tokenizer = engine.tokenizer
        self.template = template
        self.model_path = model_path
        self.slots = SlotManager(engine.n_slots, engine.n_ctx_slot, self.args.slot_prompt_similarity)
        self.grammars = GrammarBackend(engine.tokenizer, engine.core.model_config.n_vocab)
        self.engine = engine  # last: require_ready() passes from now on

    @property
    def ready(self) -> bool:
        """True once the model is loaded."""
        return self.engine is not None

    def require_ready(self) -> None:
        """Raise ApiError 503 ``Loading model`` while the model loads, 500 when loading failed
        or the engine died (every route, /health included, then says so at once)."""
        if self.engine is None:
            if self.load_error:
                raise ApiError(500, f"model failed to load: {self.load_error}")
            raise ApiError(503, "Loading model")
        err = self.engine.error
        if err is not None:
            raise ApiError(500, f"the engine failed ({type(err).__name__}) and serves no more requests: "
                                "restart the server")


def fair_share(state: ServerState) -> asyncio.Semaphore:
    """The gate one request's sequences (prompts x ``n``) pass to reach :func:`generate`:
    at most ``n_slots`` of them wait for or hold a slot at a time. Without it a request of
    2,000 prompts queued all of them ahead of every later request (a bystander waited 120 s);
    with it each of its next sequences queues behind the requests that arrived meanwhile."""
    return asyncio.Semaphore(max(1, state.engine.n_slots if state.engine is not None else 1))


async def generate(state: ServerState, request: Request,
                   params_view: dict | None = None) -> AsyncIterator[RequestOutput]:
    """Run ``request`` in a slot and yield its outputs.

    ``request.priority_slot`` is the requested ``id_slot`` (-1 = any); it is set
    to the slot actually used. Waits (counted as deferred) while every slot is
    busy. Validation errors (InvalidRequestError, ContextSizeExceededError) and
    a bad ``id_slot`` (ApiError 400) are raised before the first output. Closing
    the iterator early (client disconnect) aborts the request in the engine and
    frees the slot.

    Args:
        params_view: what ``/slots`` shows as the slot's ``params`` (defaults to
            the request's sampling parameters).
    """
    state.require_ready()
    engine, slots = state.engine, state.slots
    assert engine is not None and slots is not None
    engine.validate(request)
    if request.priority_slot >= len(slots.slots):
        raise ApiError(400, f"Invalid id_slot: {request.priority_slot}")
    slot = await slots.acquire(request.prompt_token_ids, request.priority_slot)
    try:
        request.priority_slot = slot.id
        if params_view is None:
            from kvserve.faces.params import params_to_dict

            params_view = params_to_dict(request.params)
        slot.begin(request.prompt_token_ids, slots.next_task_id(), request.params.n_predict, params_view)
        stream = engine.generate(request)
        try:
            async for out in stream:
                slot.update(out)
                state.metrics.on_output(out)
                yield out
        finally:
            await stream.aclose()
    finally:
        slots.release(slot)
