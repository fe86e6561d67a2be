"""Compiling constraints with xgrammar and the per-request matcher the engine drives.

:class:`GrammarBackend` is built once per loaded model. It describes the vocabulary to
xgrammar (raw token bytes; control tokens as ``b""`` so xgrammar never allows them inside
constrained text; the end-of-generation ids as stop tokens, allowed only where the grammar
may end), compiles a :class:`ConstraintSpec` into an ``xgrammar.CompiledGrammar`` (an LRU
cache keyed by the spec; the tokenizer is fixed per backend) and hands out
:class:`GrammarConstraint` objects, the engine's hook (``Request.grammar``).

Regular expressions: ``.`` means "any character but a newline" (Python's ``re``, which
vLLM's ``regex`` field follows); xgrammar's ``.`` includes newlines, so it is rewritten.
``^``/``$`` inside an expression are refused (see :mod:`kvserve.structured.regex`).

JSON whitespace: schemas and ``json_object`` are compiled with ``any_whitespace=True`` and
``max_whitespace_cnt=20``, so at each gap between JSON tokens the model may write up to 20
spaces, tabs or newlines. Trained models write the JSON layout they learned (compact or
indented) without being forced into one; the bound (like llama.cpp's ``space`` rule, seed
000 Example 12) keeps a weak model from looping on whitespace until ``n_predict``. For the
same reason numbers have at most 16 digits before the point (and 15 after it or in the
exponent) unless a schema bound needs more, as in llama.cpp's JSON grammars.

Two repairs of xgrammar's JSON grammar text (``bound_numbers`` and the string class for
``minLength``/``maxLength``, which let raw control characters into JSON strings) are applied
to the EBNF it prints, which is then parsed again; ``generation_settings.grammar`` shows the
repaired text.

xgrammar is imported on first use (importing it costs ~1.5 s), not when the server starts.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.errors import InvalidInputError, UnavailableError
from kvserve.structured.gbnf import GbnfError, gbnf_to_ebnf
from kvserve.structured.regex import RegexError, check_anchors, python_dots
from kvserve.structured.schema import SchemaError, check_schema
from kvserve.structured.spec import ConstraintSpec
from kvserve.structured.xgr import xgrammar_module
from kvserve.structured.xgrammar_text import clean_error

if TYPE_CHECKING:  # pragma: no cover
    import xgrammar

__all__ = ["MAX_DIGITS", "MAX_WHITESPACE", "CompiledConstraint", "GrammarBackend", "GrammarConstraint", "bound_numbers",
           "clean_error"]

log = logging.getLogger("kvserve.structured")

#: most whitespace characters the model may write at one gap of a JSON value.
MAX_WHITESPACE = 20
#: most digits of a JSON number's integral part (and of its fraction and exponent), as in
#: llama.cpp's JSON grammars (``[1-9] [0-9]{0,15}``).
MAX_DIGITS = 16

#: the character class xgrammar gives strings with minLength/maxLength: it lets raw control
#: characters (a tab, NUL...) into the JSON string, which JSON forbids; replaced by one that
#: does not (escapes stay unavailable in such strings: valid, a little narrower).
_LENGTH_CHAR_XGR = r'(([^\"\\\r\n]))'
_LENGTH_CHAR_JSON = r'(([^\0-\x1f\"\\]))'
_LABEL = {"grammar": "grammar", "json_schema": "json_schema", "json_object": "json_object", "regex": "regex",
          "choice": "choice"}


#: a string literal, or a character class (scanned past so that its ``\"`` starts no string).
_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
_DIGIT_STAR = re.compile(r"\[0-9\]\*")


def bound_numbers(ebnf: str) -> str:
    """Cap digit runs in xgrammar's JSON grammar at :data:`MAX_DIGITS` (as llama.cpp's JSON
    grammars do): ``[0-9]*`` -> ``[0-9]{0,15}``, ``digit{n, -1}`` -> ``digit{n, max(n, 15)}``.

    A weak model otherwise writes a number's digits until ``n_predict``. String literals
    (consts, ``Regex("...")`` of patterns) are left alone.
    """
    names = _DIGIT_RULE.findall(ebnf)
    rep = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\{(\d+), -1\}") if names else None
    cap = MAX_DIGITS - 1

    def fix(seg: str) -> str:
        seg = _DIGIT_STAR.sub(f"[0-9]{{0,{cap}}}", seg)
        if rep is not None:
            seg = rep.sub(lambda m: f"{m.group(1)}{{{m.group(2)}, {max(int(m.group(2)), cap)}}}", seg)
        return seg

    out, last = [], 0
    for m in _LITERAL_OR_CLASS.finditer(ebnf):
        if not m.group(0).startswith('"'):
            continue
        out.append(fix(ebnf[last:m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(fix(ebnf[last:]))
    return "".join(out)


def _ebnf_string(s: str) -> str:
    """A string literal for xgrammar's EBNF (escapes quote, backslash and control characters)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` for a list of literal choices (an empty string is ``""``)."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


@dataclass(frozen=True)
class CompiledConstraint:
    """A compile-cache entry.

    Attributes:
        compiled: the ``xgrammar.CompiledGrammar`` (shared by every matcher made from it).
        text: the grammar to report (``generation_settings.grammar``): GBNF as given, else
            the EBNF xgrammar produced.
    """

    compiled: Any
    text: str

    @property
    def nbytes(self) -> int:
        """Memory the entry holds (bytes): xgrammar's compiled size plus the text."""
        return int(getattr(self.compiled, "memory_size_bytes", 0)) + len(self.text)


class GrammarConstraint:
    """One request's constraint: the engine hook ``Request.grammar``.

    The hook protocol (see ``kvserve.engine.request.Request``):

    - ``mask() -> torch.Tensor | None``: bool [n_vocab] on CPU, True = allowed next; end-of-
      generation ids are True only where the grammar may end (then they are the only ones
      once it must end);
    - ``accept_token(token_id) -> bool``: advance by a sampled token that is not an
      end-of-generation token; False (state unchanged) when the grammar does not allow it;
    - ``is_terminated() -> bool``: True once a stop token was accepted.

    Not thread-safe: used by the engine thread only after it is created.

    Args:
        matcher: a fresh ``xgrammar.GrammarMatcher``.
        n_vocab: width of the model's logits (may exceed the tokenizer's size; the extra ids
            are never allowed).
        vocab_size: the TokenizerInfo's vocabulary size (>= n_vocab).
        stop_ids: the stop (end-of-generation) ids, for the mask of a terminated matcher.
        text: the grammar text (what ``generation_settings.grammar`` reports).
    """

    __slots__ = ("_bitmask", "_matcher", "_n_vocab", "_pending", "_stop_ids", "_vocab_size", "text")

    def __init__(self, matcher: xgrammar.GrammarMatcher, n_vocab: int, vocab_size: int, stop_ids: list[int],
                 text: str):
        xgr = xgrammar_module()
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(vocab_size / 32)]
        self._n_vocab = int(n_vocab)
        self._vocab_size = int(vocab_size)
        self._stop_ids = [t for t in stop_ids if 0 <= t < n_vocab]
        self._pending = None  # (MaskBatch, row) while a batch computes this constraint's mask
        self.text = text

    @staticmethod
    def prefetch_masks(constraints: list[GrammarConstraint], background: bool = True):
        """The engine's batch hook: start filling the next-token masks of ``constraints`` (the
        step's constrained rows) in one xgrammar batch call, in a worker thread while the
        forward runs (``background``); each one's next :meth:`mask` returns its row.

        Returns a handle whose ``release()`` the engine calls once the step sampled, or None
        (see :func:`kvserve.structured.batch.prefetch_masks`)."""
        from kvserve.structured.batch import prefetch_masks

        return prefetch_masks(constraints, background)

    def mask(self) -> torch.Tensor:
        """Allowed next tokens: bool [n_vocab] (CPU), True = allowed; never all False.

        ~10-50 us for a 49k vocabulary: xgrammar fills a packed int32 bitmask, which
        ``np.unpackbits`` expands (bit j of word i is token 32 * i + j). After
        :meth:`prefetch_masks` it is the row the batch computed (the same bits; a view of
        the batch's [B, n_vocab] tensor, not to be written to).
        """
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending[0].rows()[pending[1]]
        if self._matcher.is_terminated():
            m = torch.zeros(self._n_vocab, dtype=torch.bool)
            m[self._stop_ids] = True
            return m
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[: self._n_vocab]
        if not bits.any():
            # nothing can continue the text (cannot happen with a vocabulary that has every byte):
            # end the request rather than fail the engine step (the sampler raises on an empty mask)
            log.warning("output constraint allows no token; allowing only end-of-generation tokens")
            bits[self._stop_ids] = 1
        return torch.from_numpy(bits).view(torch.bool)

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (nothing changes) when the grammar does not allow it."""
        if self._pending is not None:  # a prefetched mask is for the state before this token
            batch, self._pending = self._pending[0], None
            batch.rows()  # the worker is done with the matcher before it changes
        try:
            return bool(self._matcher.accept_token(int(token_id)))
        except Exception:  # noqa: BLE001 - ids outside the vocabulary raise in xgrammar
            return False

    def is_terminated(self) -> bool:
        """True once the matcher accepted a stop token (generation must end)."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (the grammar may end here)."""
        return bool(self._matcher.is_completed())


#: the largest grammar compiled, in characters of xgrammar's EBNF text (1 MiB): larger ones are a
#: 400. Real tool sets stay well below it (150 tools of 8 typed arguments: ~620 KiB, ~2 s to
#: compile here); what takes long is a huge alternation (a 20,000-string enum: ~700 KiB, ~27 s,
#: ~180 MiB), so the cap bounds one request's compile to about a minute of a compiler thread
MAX_GRAMMAR_CHARS = 1024 * 1024
#: longest the first next-token mask of a freshly compiled grammar may take (seconds), measured
#: in a worker thread at compile time: a normal grammar fills one in well under 10 ms; an
#: ambiguous one (``(a*)*`` repeated 2,000 times: minutes per token) would stall every request
#: batched with it in the engine's step, so it is a 400 instead. xgrammar releases the GIL while
#: it fills a mask, so the probe stalls nobody; an abandoned probe runs to its end in its thread.
MAX_MASK_S = 1.0
#: most probes over :data:`MAX_MASK_S` still running (process-wide): each burns a core until its mask is
#: done (a 1 MiB ambiguous grammar: hours), so while this many run a new grammar is not probed but refused
#: with 503 (cached grammars still serve); the cores stay with the engine
MAX_RUNAWAY_PROBES = 2
_runaway_lock = threading.Lock()
_runaway = [0]  # probes over the limit still running
#: default byte budget of one backend's compile cache (xgrammar's ``memory_size_bytes`` + text)
CACHE_BYTES = 256 * 1024 * 1024


class GrammarBackend:
    """xgrammar for one tokenizer: compile cache plus matcher factory.

    Args:
        tokenizer: the model's Tokenizer (``token_bytes(id, special=False)`` gives ``b""``
            for control tokens, ``eog_token_ids``, ``__len__``).
        n_vocab: width of the model's logits (tokens); may exceed ``len(tokenizer)``.
        cache_size: compiled grammars kept (least recently used dropped first).
        cache_bytes: and at most this many bytes of them (each entry's xgrammar
            ``memory_size_bytes`` plus its text); an entry larger than the budget is used by
            its request and not kept.
        max_threads: xgrammar compiler threads.
        max_grammar_chars: the largest grammar compiled (:data:`MAX_GRAMMAR_CHARS`).
        max_mask_s: the longest a new grammar's first mask may take (:data:`MAX_MASK_S`).

    Attributes:
        cache_hits, cache_misses: compile-cache counters since creation.

    The TokenizerInfo (~0.05 s for 49k tokens) and the compiler are built on first use.
    Thread-safe: faces call ``constraint`` from the server loop or worker threads.
    """

    def __init__(self, tokenizer, n_vocab: int, *, cache_size: int = 64, cache_bytes: int = CACHE_BYTES,
                 max_threads: int = 2, max_grammar_chars: int = MAX_GRAMMAR_CHARS, max_mask_s: float = MAX_MASK_S):
        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab)
        self.vocab_size = max(self.n_vocab, len(tokenizer))
        self.stop_ids = sorted(int(t) for t in tokenizer.eog_token_ids)
        self.cache_size = int(cache_size)
        self.cache_bytes = int(cache_bytes)
        self.max_grammar_chars = int(max_grammar_chars)
        self.max_threads = int(max_threads)
        self.max_mask_s = float(max_mask_s)
        self._too_slow: OrderedDict[ConstraintSpec, str] = OrderedDict()  # refused specs -> their message
        self._bytes = 0  # of the cached entries
        self.cache_hits = 0
        self.cache_misses = 0
        self._cache: OrderedDict[ConstraintSpec, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._info = None

    # -- setup ----------------------------------------------------------------------------------

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = xgrammar_module()
                tok = self.tokenizer
                eog = set(self.stop_ids)
                vocab = [b"" if i in eog else tok.token_bytes(i, special=False) for i in range(len(tok))]
                self._info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                               stop_token_ids=self.stop_ids)
                # our LRU is the cache; xgrammar's own would hold a second copy
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=self.max_threads, cache_enabled=False)
            return self._compiler

    # -- compiling ------------------------------------------------------------------------------

    def _grammar(self, spec: ConstraintSpec):
        """The ``xgrammar.Grammar`` for a spec and the text to report; raises InvalidInputError."""
        xgr = xgrammar_module()
        kind, value = spec.kind, spec.value
        try:
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(gbnf_to_ebnf(value)), value
            if kind in ("json_schema", "json_object"):
                schema = value if kind == "json_schema" else '{"type":"object"}'
                if kind == "json_schema":
                    check_schema(json.loads(schema))
                g = xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE,
                                                 strict_mode=True)
                text = str(g)
                fixed = bound_numbers(text.replace(_LENGTH_CHAR_XGR, _LENGTH_CHAR_JSON))
                if fixed != text:
                    g = xgr.Grammar.from_ebnf(fixed)
                return g, str(g)
            if kind == "regex":
                check_anchors(value)
                g = xgr.Grammar.from_regex(python_dots(value))
                return g, str(g)
            g = xgr.Grammar.from_ebnf(choice_ebnf(json.loads(value)))
            return g, str(g)
        except (GbnfError, SchemaError, RegexError) as e:
            raise InvalidInputError(f"{_LABEL[kind]}: {e}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own types
            raise InvalidInputError(f"{_LABEL[kind]}: {clean_error(e)}") from None

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile ``spec`` (or take it from the LRU cache).

        Returns:
            CompiledConstraint (the xgrammar CompiledGrammar and the grammar text).

        Raises:
            InvalidInputError: ``<kind>: <what is wrong>`` (a face answers 400) for an invalid
                grammar, regex or schema (xgrammar's message without its source-file prefix), or
                one whose first next-token mask takes over ``max_mask_s``.
            UnavailableError: too many such masks still running (503, see :meth:`_probe`).
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return hit
            self.cache_misses += 1
            slow = self._too_slow.get(spec)
        if slow is not None:
            raise InvalidInputError(slow)
        compiler = self._get_compiler()
        grammar, text = self._grammar(spec)
        size = len(str(grammar)) if spec.kind == "grammar" else len(text)
        if size > self.max_grammar_chars:
            raise InvalidInputError(f"{_LABEL[spec.kind]}: the grammar is too large ({size} characters of EBNF; "
                                    f"at most {self.max_grammar_chars})")
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise InvalidInputError(f"{_LABEL[spec.kind]}: {clean_error(e)}") from None
        self._probe(spec, compiled)
        entry = CompiledConstraint(compiled, text)
        if entry.nbytes > self.cache_bytes:
            return entry  # used by this request only
        with self._lock:
            old = self._cache.pop(spec, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._cache[spec] = entry
            self._bytes += entry.nbytes
            while len(self._cache) > self.cache_size or self._bytes > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._bytes -= dropped.nbytes
        return entry

    def _probe(self, spec: ConstraintSpec, compiled) -> None:
        """Fill one next-token mask of ``compiled`` in a daemon thread.

        Raises:
            InvalidInputError: it took longer than ``max_mask_s`` (the spec is remembered as refused;
                the fill runs on to its end in its thread).
            UnavailableError: :data:`MAX_RUNAWAY_PROBES` such fills are still running (503).
        """
        xgr = xgrammar_module()
        settled = threading.Event()  # set by whichever comes first: the end of the fill, or the timeout

        def fill():
            try:
                xgr.GrammarMatcher(compiled).fill_next_token_bitmask(xgr.allocate_token_bitmask(1, self.vocab_size))
            finally:
                with _runaway_lock:
                    if settled.is_set():  # timed out before: no longer running
                        _runaway[0] -= 1
                    settled.set()

        with _runaway_lock:
            if _runaway[0] >= MAX_RUNAWAY_PROBES:
                raise UnavailableError(f"{_LABEL[spec.kind]}: {_runaway[0]} grammars too expensive to enforce are "
                                       "still being measured; try again later")
        worker = threading.Thread(target=fill, name="kvserve-grammar-probe", daemon=True)
        worker.start()
        worker.join(self.max_mask_s)
        with _runaway_lock:
            if settled.is_set():  # finished in time
                return
            settled.set()
            _runaway[0] += 1
        message = (f"{_LABEL[spec.kind]}: the grammar is too expensive to enforce (one next-token mask takes "
                   f"more than {self.max_mask_s:g} s; an ambiguous expression such as nested repetition "
                   "'(a*)*' usually causes it)")
        with self._lock:
            self._too_slow[spec] = message
            while len(self._too_slow) > self.cache_size:
                self._too_slow.popitem(last=False)
        log.warning("refused a grammar whose first mask took over %g s", self.max_mask_s)
        raise InvalidInputError(message)

    def grammar_text(self, spec: ConstraintSpec) -> str:
        """What ``generation_settings.grammar`` shows: GBNF as given, else xgrammar's EBNF.

        Raises:
            InvalidInputError: as :meth:`compile`.
        """
        return self.compile(spec).text

    def constraint(self, spec: ConstraintSpec, prefill: str = "") -> GrammarConstraint:
        """A fresh matcher for one request (each request needs its own).

        Args:
            spec: the constraint.
            prefill: text the constrained output already starts with (a continued final
                assistant message); it is fed to the matcher first.

        Raises:
            InvalidInputError: a spec that does not compile, or a ``prefill`` the constraint
                does not allow.
        """
        xgr = xgrammar_module()
        entry = self.compile(spec)
        matcher = xgr.GrammarMatcher(entry.compiled)
        if prefill and not matcher.accept_string(prefill):
            raise InvalidInputError(f"the message being continued ({prefill[:40]!r}) does not match the "
                                    f"requested {spec.kind} constraint")
        return GrammarConstraint(matcher, self.n_vocab, self.vocab_size, self.stop_ids, entry.text)

    def cache_info(self) -> dict:
        """``{"size", "capacity", "hits", "misses", "bytes", "capacity_bytes"}`` of the compile cache."""
        with self._lock:
            return {"size": len(self._cache), "capacity": self.cache_size, "hits": self.cache_hits,
                    "misses": self.cache_misses, "bytes": self._bytes, "capacity_bytes": self.cache_bytes}
