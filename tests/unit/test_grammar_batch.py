"""Grammar masks in batch (issue #17 item 4): the masks xgrammar's batch matcher fills for all
constrained rows of a step (in a worker thread beside the forward) are bit for bit the masks each
row computes alone, and the engine's tokens are the same with the batch on and off."""

import random

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.loaders.tokenizer import Tokenizer
from kvserve.models.build import load_files
from kvserve.structured import batch as mask_batch
from kvserve.structured.backend import ConstraintSpec, GrammarBackend, GrammarConstraint
from kvserve.structured.spec import schema_spec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "tags": {"type": "array",
                                                                             "items": {"enum": ["a", "b c"]}}},
          "required": ["name", "n", "tags"]}
SPECS = [
    schema_spec(SCHEMA, "json_schema"),
    ConstraintSpec("json_object", ""),
    ConstraintSpec("regex", r"[a-z]{2,6}-\d{1,3}( [A-Z]+)?"),
    ConstraintSpec("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]+'),
]


@pytest.fixture(scope="module")
def backend(smollm2_gguf) -> GrammarBackend:
    tok = Tokenizer.from_gguf_file(smollm2_gguf)
    return GrammarBackend(tok, tok.n_vocab)


def _walk(backend, n_rows: int, steps: int, background: bool, seed: int = 3) -> int:
    """Drive ``n_rows`` constraint pairs (batched, alone) along the same random allowed tokens;
    compare every mask; returns the rows compared."""
    rng = random.Random(seed)
    pairs = [(backend.constraint(SPECS[i % len(SPECS)]), backend.constraint(SPECS[i % len(SPECS)]))
             for i in range(n_rows)]
    eog = set(backend.stop_ids)
    compared = 0
    for _ in range(steps):
        live = [(b, a) for b, a in pairs if not a.is_terminated()]
        if not live:
            break
        batch = GrammarConstraint.prefetch_masks([b for b, _ in live], background)
        assert (batch is None) == (len(live) < mask_batch.MIN_ROWS)
        for b, a in live:
            got, want = b.mask(), a.mask()
            assert got.dtype == torch.bool and got.shape == (backend.n_vocab,)
            assert torch.equal(got, want)
            compared += 1
            allowed = want.nonzero().flatten().tolist()
            text = [t for t in allowed if t not in eog]
            # mostly text tokens, an end-of-generation token now and then where allowed
            tok = rng.choice(text) if text and (len(text) == len(allowed) or rng.random() < 0.9) else \
                rng.choice(sorted(eog & set(allowed)))
            assert b.accept_token(tok) == a.accept_token(tok) is True
        if batch is not None:
            batch.release()
    return compared


@pytest.mark.parametrize("background", [True, False])
def test_batched_masks_equal_single_masks_bit_for_bit(backend, background):
    mask_batch.STATS.reset()
    n = _walk(backend, 16, 40, background)
    assert n > 300
    assert mask_batch.STATS.rows == n and mask_batch.STATS.batches >= 20


def test_one_row_is_not_batched(backend):
    assert mask_batch.MIN_ROWS == 2
    c = backend.constraint(SPECS[0])
    for background in (False, True):
        assert GrammarConstraint.prefetch_masks([c], background) is None and c._pending is None


def test_one_row_batch(backend, monkeypatch):
    monkeypatch.setattr(mask_batch, "MIN_ROWS", 1)
    assert _walk(backend, 1, 30, True, seed=9) > 10


def test_terminated_repeated_and_released(backend):
    eos = backend.stop_ids[0]
    done = backend.constraint(ConstraintSpec("grammar", 'root ::= "yes"'))
    for t in backend.tokenizer.encode("yes", add_special=False):
        assert done.accept_token(t)
    assert done.accept_token(eos) and done.is_terminated()
    live = backend.constraint(SPECS[0])
    ref = backend.constraint(SPECS[0])
    live2 = backend.constraint(SPECS[1])
    b = GrammarConstraint.prefetch_masks([done, live, live, live2], True)
    assert b is not None and b.constraints == [live, live2]  # the terminated one and the repeat left out
    assert done._pending is None
    assert torch.equal(done.mask(), _only(backend, backend.stop_ids))
    b.release()  # the step did not sample this row: its mask() computes afresh
    assert live._pending is None and torch.equal(live.mask(), ref.mask())
    # accepting a token while a prefetched mask is pending drops that mask
    GrammarConstraint.prefetch_masks([live, live2], True)
    tok = backend.tokenizer.encode("{", add_special=False)[0]
    assert live.accept_token(tok) and ref.accept_token(tok)
    assert live._pending is None and torch.equal(live.mask(), ref.mask())
    assert GrammarConstraint.prefetch_masks([done, done], True) is None


def _only(backend, ids):
    m = torch.zeros(backend.n_vocab, dtype=torch.bool)
    m[ids] = True
    return m


# -- the engine ----------------------------------------------------------------------------------

class _Plain:
    """A constraint-protocol object without the batch hook (e.g. a wrapper): computes its own mask."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def mask(self):
        self.calls += 1
        return self.inner.mask()

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def is_terminated(self):
        return self.inner.is_terminated()


def _run(core, reqs):
    out = {r.request_id: [[], "", None] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        for o in core.step():
            e = out[o.request_id]
            e[0] += o.new_token_ids
            e[1] += o.text
            if o.finished:
                e[2] = o.stop_type
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_core(tiny_gguf) -> EngineCore:
    return EngineCore(load_files(tiny_gguf), EngineConfig(n_ctx=2048, dtype="float32", n_parallel=20,
                                                          kv_unified=True))


@pytest.mark.parametrize("mode", ["overlap", "batch"])
def test_sixteen_constrained_streams_same_tokens_batched_or_not(tiny_core, mode):
    core = tiny_core
    tok = core.tokenizer
    nv = core.model_config.n_vocab
    be = GrammarBackend(tok, nv)
    specs = [ConstraintSpec("grammar", 'root ::= "ab" [0-9]{2,5} "." [a-c]*'),
             ConstraintSpec("regex", "[a-e]{3,12}"),
             ConstraintSpec("json_object", "")]

    def reqs(tag):
        rs = []
        for i in range(16):
            p = SamplingParams(n_predict=24, temperature=0.0) if i % 2 == 0 else \
                SamplingParams(n_predict=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i)
            g = be.constraint(specs[i % 3])
            rs.append(Request(f"{tag}{i}", tok.encode(f"item {i}:", add_special=True), p,
                              grammar=_Plain(g) if i == 5 else g))
        rs.append(Request(f"{tag}free", tok.encode("free", add_special=True),
                          SamplingParams(n_predict=10, temperature=0.0)))
        return rs

    core.grammar_batch = False
    a = _run(core, reqs("a"))
    core.grammar_batch, core.grammar_overlap = True, mode == "overlap"
    mask_batch.STATS.reset()
    rs = reqs("b")
    b = _run(core, rs)
    core.grammar_overlap = True
    for i in [*range(16), "free"]:
        assert a[f"a{i}"] == b[f"b{i}"], i
    assert mask_batch.STATS.rows > 100 and mask_batch.STATS.batches >= 10
    assert rs[5].grammar.calls > 5  # the hook-less constraint computed its own masks in the same steps
    assert all(r.grammar is None or getattr(r.grammar, "_pending", None) is None for r in rs)
