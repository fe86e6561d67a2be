"""One engine's LoRA adapters: ids, names, global scales, limits (see the package docstring).

Thread safety: ``add`` / ``remove`` / ``set_scales`` may be called from the HTTP side while the engine
steps; each replaces whole dict entries (atomic under the GIL) and the engine reads a snapshot per
step (:meth:`LoraRegistry.batch`), so a step sees an adapter wholly or not at all.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Iterable

import torch

from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.lora.adapter import LoraAdapter, LoraBase

#: ``--lora-dtype`` names (vLLM's) and their torch dtypes ("auto": the model's)
LORA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: the largest |scale| accepted (global or per request): far past 1 an adapter's delta only adds
#: noise, and 1e308 would overflow float32 to inf and NaN logits
MAX_SCALE = 1000.0


def check_scale(scale, what: str = "scale") -> float:
    """``scale`` as a float; InvalidInputError for a non-number, NaN, inf or |scale| > MAX_SCALE."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidInputError(f"LoRA {what} must be a number, got {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or abs(s) > MAX_SCALE:
        raise InvalidInputError(f"LoRA {what} must be a finite number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], "
                                f"got {scale!r}")
    return s


@dataclass(slots=True)
class LoraEntry:
    """One registered adapter: ``id`` (llama-server's adapter id), ``name``, ``path``, ``scale`` (the
    global scale, llama-server's ``POST /lora-adapters``; 0 = not applied by default) and the adapter."""

    id: int
    name: str
    path: str
    scale: float
    adapter: LoraAdapter
    #: bytes per element of its installed (fused) A and B: :attr:`LoraRegistry.dtype`'s when it was added
    itemsize: int = 4


class LoraRegistry:
    """The adapters of one model (per engine), and the per-step batch the model's Linears read.

    Args:
        model: the LlamaModel (or family built on it) the adapters apply to.
        max_loras: most distinct adapters in one engine step (vLLM's ``--max-loras``); None = no
            limit (llama-server, which applies all its adapters to one batch). The scheduler holds
            back rows that would exceed it; a request naming more adapters is refused.
        max_lora_rank: the largest rank accepted by :meth:`add` (vLLM's ``--max-lora-rank``); None =
            any.
        lora_dtype: the dtype adapters are installed in (vLLM's ``--lora-dtype``): "auto" (the model's
            compute dtype: float32 on the CPU), "float32", "bfloat16" or "float16"; set it before
            adding adapters (those added earlier keep theirs).
    """

    def __init__(self, model, max_loras: int | None = None, max_lora_rank: int | None = None,
                 lora_dtype: str = "auto"):
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.lora_dtype = lora_dtype
        self._entries: dict[int, LoraEntry] = {}
        #: every adapter still in the model: the registered ones and those removed while requests use them
        self._installed: dict[int, LoraEntry] = {}
        #: adapter id -> requests in the engine applying it (:meth:`hold` / :meth:`release`)
        self._users: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        #: the step being computed (set by ModelRunner.run around the forward), read by LoraLinear
        self.active = None
        self._base: LoraBase | None = None

    # -- the base --------------------------------------------------------------------------------

    @property
    def base(self) -> LoraBase:
        """The base model's architecture and projection shapes (what adapters are checked against)."""
        if self._base is None:
            self._base = LoraBase.of(self.model)
        return self._base

    def load(self, path: str, name: str | None = None, scale: float = 1.0) -> int:
        """Read an adapter (:func:`kvserve.lora.load_adapter`) and :meth:`add` it; its id."""
        from kvserve.lora.adapter import load_adapter

        return self.add(load_adapter(path, self.base, name), scale)

    # -- the set ---------------------------------------------------------------------------------

    def add(self, adapter: LoraAdapter, scale: float = 1.0) -> int:
        """Register ``adapter`` with global ``scale``; its new id (ids count up from 0, never reused).

        Raises InvalidInputError: its rank is above ``max_lora_rank``, its name is taken, it was
        checked against another architecture, or the scale is out of range."""
        s = check_scale(scale)
        if self.max_lora_rank is not None and adapter.rank > self.max_lora_rank:
            raise InvalidInputError(f"LoRA adapter {adapter.path}: rank {adapter.rank} is greater than "
                                    f"--max-lora-rank {self.max_lora_rank}")
        if adapter.base_arch != self.base.arch:
            raise InvalidInputError(f"LoRA adapter {adapter.path}: made for a {adapter.base_arch!r} base, this "
                                    f"model is {self.base.arch!r}")
        for mod, m in adapter.modules.items():
            want = self.base.shapes.get(mod)
            if want != (m.b.shape[0], m.a.shape[1]):
                raise InvalidInputError(f"LoRA adapter {adapter.path}: {mod} does not match the base model "
                                        f"({[m.b.shape[0], m.a.shape[1]]} vs {list(want) if want else 'absent'})")
        from kvserve.lora.apply import install

        with self._lock:
            if any(e.name == adapter.name for e in self._entries.values()):
                raise InvalidInputError(f"LoRA adapter name {adapter.name!r} is already loaded")
            aid = self._next_id
            self._next_id += 1
            dtype = self.dtype
            install(self, self.model, aid, adapter, dtype)
            self._entries[aid] = self._installed[aid] = LoraEntry(aid, adapter.name, adapter.path, s, adapter,
                                                                  dtype.itemsize)
        return aid

    def remove(self, name_or_id: str | int) -> LoraEntry:
        """Unregister an adapter by name or id; the removed entry. New requests can no longer name
        it; requests in the engine that apply it (:meth:`hold`) keep getting its delta to their end:
        its weights leave the model at the last one's :meth:`release` (vLLM keeps serving them too).

        Raises NotFoundError: no such adapter."""
        from kvserve.lora.apply import uninstall

        with self._lock:
            e = self._find(name_or_id)
            del self._entries[e.id]
            if not self._users.get(e.id):
                uninstall(self.model, e.id)
                del self._installed[e.id]
        return e

    def hold(self, lora: Iterable[tuple[int, float]]) -> None:
        """Count one more request in the engine applying each adapter of ``lora`` (``(id, scale)``
        pairs; the engine calls it when it takes a request, :meth:`release` when the request leaves).

        Raises InvalidInputError: an adapter was removed since the request was checked (nothing counted)."""
        ids = [aid for aid, _ in lora]
        with self._lock:
            gone = [aid for aid in ids if aid not in self._entries]
            if gone:
                raise InvalidInputError(f"LoRA adapter {gone[0]} was unloaded before the request started")
            for aid in ids:
                self._users[aid] = self._users.get(aid, 0) + 1

    def release(self, lora: Iterable[tuple[int, float]]) -> None:
        """One request applying ``lora`` left the engine; an adapter removed meanwhile leaves the model
        with its last request."""
        from kvserve.lora.apply import uninstall

        with self._lock:
            for aid, _ in lora:
                n = self._users.get(aid, 0) - 1
                if n > 0:
                    self._users[aid] = n
                    continue
                self._users.pop(aid, None)
                if aid in self._installed and aid not in self._entries:
                    uninstall(self.model, aid)
                    del self._installed[aid]

    def users(self, aid: int) -> int:
        """Requests in the engine applying adapter ``aid`` now."""
        return self._users.get(aid, 0)

    def _find(self, name_or_id: str | int) -> LoraEntry:
        if isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
            e = self._entries.get(name_or_id)
        else:
            e = next((x for x in self._entries.values() if x.name == name_or_id), None)
        if e is None:
            raise NotFoundError(f"LoRA adapter {name_or_id!r} not found")
        return e

    def get(self, name: str) -> LoraEntry | None:
        """The entry named ``name`` (None when there is none)."""
        return next((x for x in self._entries.values() if x.name == name), None)

    def by_id(self, aid: int) -> LoraEntry | None:
        """The entry of id ``aid`` (None when there is none)."""
        return self._entries.get(aid)

    def entries(self) -> list[LoraEntry]:
        """Every entry, by id."""
        return [self._entries[k] for k in sorted(self._entries)]

    def known_ids(self):
        """The ids of the adapters in the model (a live view; read per step by the native decode step):
        the registered ones and those removed while requests still apply them."""
        return self._installed.keys()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype :attr:`lora_dtype` names (auto: the model's ``compute_dtype``, else float32).

        Raises ValueError: an unknown name."""
        if self.lora_dtype == "auto":
            return getattr(self.model, "compute_dtype", torch.float32)
        try:
            return LORA_DTYPES[self.lora_dtype]
        except KeyError:
            raise ValueError(f"unsupported lora_dtype {self.lora_dtype!r} (auto, {', '.join(LORA_DTYPES)})") from None

    @property
    def nbytes(self) -> int:
        """Bytes of every adapter's tensors in the model (A, B as loaded, float32, and the engine's fused
        copies in :attr:`dtype`)."""
        return sum(self.installed_nbytes(e.adapter, e.itemsize) for e in list(self._installed.values()))

    def installed_nbytes(self, adapter: LoraAdapter, itemsize: int | None = None) -> int:
        """Bytes ``adapter`` holds once added: its float32 A and B plus the fused copies in :attr:`dtype`
        (``itemsize`` bytes per element; default: :attr:`dtype`'s)."""
        itemsize = self.dtype.itemsize if itemsize is None else itemsize
        return adapter.nbytes + adapter.nbytes * itemsize // 4

    # -- scales ----------------------------------------------------------------------------------

    def set_scales(self, scales: dict[int, float], clear_others: bool = True) -> None:
        """Set the global scales (llama-server's ``POST /lora-adapters``: adapters not listed get 0
        unless ``clear_others`` is False). All checked before any is set.

        Raises InvalidInputError: an unknown id or a bad scale."""
        checked = {}
        for aid, s in scales.items():
            if isinstance(aid, bool) or not isinstance(aid, int) or aid not in self._entries:
                raise InvalidInputError(f"invalid adapter id {aid!r}: no LoRA adapter has it")
            checked[aid] = check_scale(s)
        for aid, e in self._entries.items():
            if aid in checked:
                e.scale = checked[aid]
            elif clear_others:
                e.scale = 0.0

    def default_lora(self) -> tuple[tuple[int, float], ...]:
        """The global scales as a request's ``lora`` tuple (adapters of scale 0 left out)."""
        return tuple((e.id, e.scale) for e in self.entries() if e.scale != 0.0)

    def resolve(self, lora: Iterable[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
        """A request's adapters checked and normalized: None -> :meth:`default_lora`; else each
        ``(id, scale)`` checked (a known id, a scale :func:`check_scale` takes), zero scales
        dropped, sorted by id. Adapters not listed are not applied (llama-server: scale 0).

        Raises InvalidInputError: an unknown id, a repeated id, a bad scale, or more adapters than
        ``max_loras``."""
        if lora is None:
            out = self.default_lora()
        else:
            seen: dict[int, float] = {}
            for item in lora:
                try:
                    aid, s = item
                except (TypeError, ValueError) as e:
                    raise InvalidInputError("lora entries must be (id, scale) pairs") from e
                if isinstance(aid, bool) or not isinstance(aid, int) or aid not in self._entries:
                    raise InvalidInputError(f"invalid adapter id {aid!r}: no LoRA adapter has it"
                                            f" (loaded: {sorted(self._entries)})")
                if aid in seen:
                    raise InvalidInputError(f"LoRA adapter id {aid} is listed twice")
                seen[aid] = check_scale(s)
            out = tuple(sorted((a, s) for a, s in seen.items() if s != 0.0))
        if self.max_loras is not None and len(out) > self.max_loras:
            raise InvalidInputError(f"the request applies {len(out)} LoRA adapters, more than --max-loras "
                                    f"{self.max_loras} in one step")
        return out

    # -- the engine's step -----------------------------------------------------------------------

    def batch(self, row_lora: list[tuple[int, int, tuple[tuple[int, float], ...]]], device) -> "object | None":
        """The step's row groups (kvserve.lora.apply.LoraBatch) from ``(first row, end row, lora)``
        ranges in batch order; None when no row carries an adapter."""
        from kvserve.lora.apply import LoraBatch

        return LoraBatch.build(row_lora, self._installed.keys(), device)
