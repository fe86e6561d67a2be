"""A stand-in for the model: scheduler and engine-core tests in milliseconds, with no weights.

:class:`FakeRunner` has :class:`~kvserve.engine.model_runner.ModelRunner`'s interface but runs no
forward: the token sampled after a sequence is a fixed function of its last token
(:func:`next_token`), so every test knows the whole output in advance. It checks the
scheduler's promises as it goes (every scheduled token has a KV row of the sequence's block
table) and records each step. :func:`fake_engine_core` builds a real
:class:`~kvserve.engine.core.EngineCore` (scheduler, KV cache manager, detokenizer, stop
rules) around it, with :class:`FakeTokenizer`'s vocabulary of ``<id>`` pieces.

Not modelled: sampling parameters (every request decodes greedily through
:func:`next_token`), grammars' masks, prompt logprobs (None), KV contents (slot files and KV
shifting move no rows: ``read_rows`` raises).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.model_runner import StepResult
from kvserve.engine.sampler import SampleResult, SequenceSampler
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.loaders.weights import LoadedModel, ModelConfig, ModelInfo

#: FakeTokenizer's special ids
BOS, EOS = 1, 2
#: the first id :func:`next_token` produces (0..2 are pad/BOS/EOS)
FIRST_PLAIN = 3


def next_token(last: int, n_vocab: int) -> int:
    """The fake model's prediction after token ``last``: ``3 + (7 * last + 1) mod (n_vocab - 3)``,
    never a special id (generation ends by ``n_predict``, a stop string or the context)."""
    return FIRST_PLAIN + (7 * last + 1) % (n_vocab - FIRST_PLAIN)


def expected_tokens(prompt: list[int], n: int, n_vocab: int) -> list[int]:
    """The ``n`` tokens the fake model generates after ``prompt``."""
    out: list[int] = []
    last = prompt[-1]
    for _ in range(n):
        last = next_token(last, n_vocab)
        out.append(last)
    return out


class FakeTokenizer:
    """A vocabulary of ``n_vocab`` tokens: id ``i`` is the piece ``<i>`` (bytes), 1 is BOS and 2 EOS.

    Offers what the engine uses: ``token_bytes``, ``decode``, ``eog_token_ids``, ``bos_token``,
    ``eos_token``."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.eog_token_ids = frozenset({EOS})
        self.bos_token_id, self.eos_token_id = BOS, EOS
        self.bos_token, self.eos_token = "<1>", "<2>"

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """``b"<id>"``; special ids (BOS, EOS) give b"" unless ``special``."""
        if token_id in (BOS, EOS) and not special:
            return b""
        return f"<{token_id}>".encode()

    def decode(self, ids, skip_special: bool = False) -> str:
        return b"".join(self.token_bytes(i, not skip_special) for i in ids).decode()


class FakeRunner:
    """ModelRunner's interface without a model (see the module docstring).

    Args:
        num_blocks, block_size: the KV pool geometry EngineCore computed (blocks, tokens per block).
        n_vocab: vocabulary size for :func:`next_token`.
        predict: ``(last token, n_vocab) -> next token`` (default :func:`next_token`).

    Attributes:
        steps: per executed step, ``(request_id, first position, tokens)`` of each chunk, in
            the scheduler's order.
        copies, shifts: every copy-on-write and KV shift job received.
        model, compiled: None (no model, nothing to compile); kv_bytes: 0.
    """

    def __init__(self, num_blocks: int, block_size: int, n_vocab: int,
                 predict: Callable[[int, int], int] = next_token):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_vocab = n_vocab
        self.predict = predict
        self.model = None
        self.compiled = None
        self.device = torch.device("cpu")
        self.kv_bytes = 0
        self.steps: list[list[tuple[str, int, int]]] = []
        self.copies: list[tuple[int, int, int]] = []
        self.shifts: list[tuple[int, int, int]] = []

    def start_compile(self, max_rows: int):
        raise NotImplementedError("the fake runner has no model to compile")

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        self.copies.extend(copies)

    def shift_rows(self, jobs: list[tuple[int, int, int]]) -> None:
        self.shifts.extend(jobs)

    def read_rows(self, rows: torch.Tensor):
        raise NotImplementedError("the fake runner holds no KV rows (slot files need a model)")

    def write_rows(self, rows: torch.Tensor, layers) -> None:
        raise NotImplementedError("the fake runner holds no KV rows (slot files need a model)")

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager, samplers: dict[str, SequenceSampler]) -> StepResult:
        """Record the step, check each chunk's cache rows exist, and "sample" each completing
        chunk's next token (logprob 0.0; ``top`` is that one token when ``n_probs`` > 0).

        Raises:
            AssertionError: a chunk's positions run past its block table, or the table
                holds the null block 0 (the scheduler broke its promise).
        """
        self.shift_rows(sched.kv_shifts)
        self.copy_blocks(sched.kv_copies)
        bs = self.block_size
        step = []
        samples: list[SampleResult | None] = []
        for ch in sched.chunks:
            req = ch.request
            s, n = req.num_computed_tokens, ch.num_new_tokens
            table = kv.block_table(req.request_id)
            assert len(table) * bs >= s + n, f"{req.request_id}: positions {s}..{s + n} past its {len(table)} blocks"
            assert 0 not in table[: -(-(s + n) // bs)], f"{req.request_id}: the null block in its table"
            step.append((req.request_id, s, n))
            if ch.completes:
                tok = self.predict(req.token_at(req.num_tokens - 1), self.n_vocab)
                samples.append(SampleResult(tok, 0.0, [(tok, 0.0)] if req.params.n_probs > 0 else None))
            else:
                samples.append(None)
        self.steps.append(step)
        return StepResult(samples, [None] * len(sched.chunks))


def fake_loaded_model(n_vocab: int = 64, n_ctx_train: int = 4096) -> LoadedModel:
    """A LoadedModel with no weights: a 1-layer llama config, FakeTokenizer, no chat template."""
    config = ModelConfig(arch="llama", n_layer=1, n_embd=8, n_head=1, n_head_kv=1, n_ff=8, n_vocab=n_vocab,
                         head_dim=8, n_ctx_train=n_ctx_train)
    info = ModelInfo(path="fake", name="fake", format="fake", arch="llama", ftype="none", n_params=0, size=0,
                     n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_embd=8)
    return LoadedModel(config=config, info=info, weights={}, tokenizer=FakeTokenizer(n_vocab))


def fake_engine_core(n_ctx: int = 256, n_parallel: int = 2, *, n_vocab: int = 64,
                     predict: Callable[[int, int], int] = next_token, **config) -> EngineCore:
    """A real EngineCore around a :class:`FakeRunner` (``core.runner``); builds in milliseconds.

    Args:
        n_ctx, n_parallel: as EngineConfig (total context in tokens, slots).
        n_vocab: the fake vocabulary's size.
        predict: the fake model (default :func:`next_token`).
        config: other EngineConfig fields; ``cache_ram`` defaults to 0 (no host tier:
            the pool is exactly ``ceil(n_ctx / block_size) + n_parallel`` blocks plus the
            null block) and ``threads`` to the current torch setting.
    """
    config.setdefault("cache_ram", 0)
    config.setdefault("threads", torch.get_num_threads())
    cfg = EngineConfig(n_ctx=n_ctx, n_parallel=n_parallel, **config)
    return EngineCore(fake_loaded_model(n_vocab), cfg,
                      make_runner=lambda num_blocks, bs: FakeRunner(num_blocks, bs, n_vocab, predict))
