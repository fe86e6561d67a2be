"""The engine's request and output types: what a face hands in and what it gets back.

A face (llama-server, OpenAI, Ollama dialect) translates its JSON into one
:class:`Request` (token ids + :class:`SamplingParams`) and consumes a stream of
:class:`RequestOutput` events. Nothing here knows about HTTP or chat.

Thread-safety: a ``Request`` is owned by the engine thread once submitted; faces
only read the ``RequestOutput`` objects they receive (those are never mutated
after being sent).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from kvserve.errors import InvalidInputError

#: llama.cpp's "pick a random seed" value (0xFFFFFFFF).
SEED_RANDOM = 4294967295

#: llama.cpp's default sampler order (``/props`` ``samplers``).
DEFAULT_SAMPLERS = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)

#: llama.cpp's default DRY sequence breakers.
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


#: SamplingParams fields that must be finite floats (NaN or inf would reach the sampler and
#: the JSON of /slots and generation_settings, which cannot carry them).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base")


#: A request the engine refuses before scheduling (HTTP 400 in every face). The engine's name
#: for :class:`kvserve.errors.InvalidInputError`, the same class: ``except InvalidRequestError``
#: also catches the chat and structured layers' input errors, and both map to one 400.
InvalidRequestError = InvalidInputError


class ContextSizeExceededError(InvalidRequestError):
    """Prompt plus n_predict cannot fit in one sequence's context.

    Carries ``n_prompt_tokens`` and ``n_ctx`` (tokens), which llama-server's
    ``exceed_context_size_error`` envelope reports.
    """

    def __init__(self, n_prompt_tokens: int, n_ctx: int, n_predict: int = 0):
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.n_predict = n_predict
        if n_prompt_tokens < n_ctx and n_predict > 0:
            # the prompt fits; prompt + requested tokens does not (llama-server's text
            # would claim fewer tokens than the context exceed it)
            msg = (f"request ({n_prompt_tokens} prompt tokens + {n_predict} requested tokens = "
                   f"{n_prompt_tokens + n_predict} tokens) exceeds the available context size "
                   f"({n_ctx} tokens), try lowering n_predict/max_tokens or increasing the context")
        else:
            msg = (f"request ({n_prompt_tokens} tokens) exceeds the available context size "
                   f"({n_ctx} tokens), try increasing it")
        super().__init__(msg)


def check_prompt(prompt_token_ids: list[int], n_predict: int, n_ctx_slot: int, n_vocab: int) -> None:
    """Refuse a prompt the engine cannot run: the engine's invariants on a request it admits.

    Read-only (it changes nothing); the serving layer calls it when it admits a request
    (:func:`kvserve.serving.admission.admit`, which first caps a server-default ``n_predict``),
    the engine again when the request arrives (:meth:`kvserve.engine.core.EngineCore.add_request`).

    Args:
        prompt_token_ids: the prompt (token ids); n_predict: tokens to generate (-1: until the
            context is full); n_ctx_slot: one sequence's context [tokens]; n_vocab: the model's
            vocabulary size (the logits' width).

    Raises:
        InvalidRequestError: ``the prompt is empty: at least one token is required``;
            ``token id N is out of range (vocabulary size V)`` (the first such id).
        ContextSizeExceededError: the prompt, or the prompt plus ``n_predict``, does not fit
            ``n_ctx_slot`` (at least one token must be left to generate).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty: at least one token is required")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= n_vocab:  # C-speed scans; the first bad id below
        bad = next(t for t in prompt_token_ids if not 0 <= t < n_vocab)
        raise InvalidRequestError(f"token id {bad} is out of range (vocabulary size {n_vocab})")
    n_gen = max(n_predict, 0)
    if n >= n_ctx_slot or n + n_gen > n_ctx_slot:
        raise ContextSizeExceededError(n, n_ctx_slot, n_gen)


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation parameters, llama.cpp names and defaults.

    Defaults follow llama-server's ``/props`` ``default_generation_settings``
    (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_last_n 64, ...).

    Attributes (units in brackets):
        n_predict: max tokens to generate; -1 = until the context is full.
        n_predict_default: ``n_predict`` is a server default (the model's ``max_new_tokens``,
            ``--override-generation-config``, ``-n``), not the request's own: admission
            (:func:`kvserve.serving.admission.admit`) caps it to the room left in the context
            (vLLM's ``get_max_tokens``: ``min(default, max_model_len - prompt_len)``) instead of
            refusing the request; the engine never changes it.
        temperature: <= 0 means greedy (argmax), as in llama.cpp.
        seed: RNG seed; ``SEED_RANDOM`` (4294967295) picks a random one.
        logit_bias: token id -> additive bias; ``float('-inf')`` bans the token,
            ``float('inf')`` forces it; NaN is refused. Faces resolve string keys /
            ``false`` before building the request.
        samplers: order of the sampler chain (names as in ``DEFAULT_SAMPLERS``).
        stop: stop strings; the matched string is not part of the output text.
        ignore_eos: keep generating past end-of-generation tokens (they are
            banned, as llama.cpp does).
        min_tokens: end-of-generation tokens are banned until this many tokens
            were generated.
        n_probs: number of top candidates to report per generated token (0 = off).
        post_sampling_probs: report probabilities after the sampler chain
            (llama.cpp ``post_sampling_probs``) instead of the raw softmax.
        prompt_logprobs: when not None, logprobs of each prompt token (and this
            many top candidates) are computed; costs logits for every position.
        cache_prompt: allow reuse of cached KV for the prompt (prefix cache).
        n_cache_reuse: KV shifting (llama-server ``n_cache_reuse`` / ``--cache-reuse``):
            minimum run of tokens [tokens] of the slot's cached sequence that is
            moved to its new position when text was removed from the prompt; 0 = off.
        spec_n_max: llama-server ``speculative.n_max``: most draft tokens per step for this
            request [tokens]; None = the server's (``--draft-max``); 0 = no speculation.
            Lowers the server's value, never raises it; a negative value is 0 (llama-server clamps).
        spec_n_min: llama-server ``speculative.n_min``: shorter drafts are dropped [tokens];
            negative is 0.
        spec_p_min: llama-server ``speculative.p_min``: a draft model stops drafting for this
            request when its top token is less likely than this; None = the server's
            (``--draft-p-min``). Must be in [0, 1].
        skip_special_tokens: vLLM's field (default True): control tokens add no text to the
            output; False renders every control token's text (llama-server ``--special``).
        spaces_between_special_tokens: vLLM's field, accepted for compatibility; it has no
            effect (as in vLLM's fast-tokenizer detokenizer, which ignores it).
        preserved_token_ids: control tokens rendered as their text although
            ``skip_special_tokens`` hides the others (llama-server's
            ``common_params_sampling.preserved_tokens``): the chat face fills it with the
            single-token markers of the request's tool-call / reasoning parser.

    Raises:
        InvalidRequestError: from ``__post_init__`` on out-of-range values, and on a
            non-finite value (NaN, inf) in any float field.
    """

    n_predict: int = -1
    n_predict_default: bool = False
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    seed: int = SEED_RANDOM
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n_probs: int = 0
    post_sampling_probs: bool = False
    prompt_logprobs: int | None = None
    cache_prompt: bool = True
    n_cache_reuse: int = 0
    spec_n_max: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    preserved_token_ids: frozenset[int] = frozenset()
    spec_n_min: int = 0
    spec_p_min: float | None = None

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}")
        if any(math.isnan(b) for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be numbers (-inf bans a token), not NaN")
        if self.n_predict < -1:
            raise InvalidRequestError("n_predict must be >= -1")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]")
        if self.n_probs < 0:
            raise InvalidRequestError("n_probs must be >= 0")
        if self.n_cache_reuse < 0:
            raise InvalidRequestError("n_cache_reuse must be >= 0")
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens must be >= 0")
        # llama-server clamps the draft sizes (params_from_json_cmpl): negative means 0
        if self.spec_n_max is not None and self.spec_n_max < 0:
            self.spec_n_max = 0
        self.spec_n_min = max(self.spec_n_min, 0)
        if self.spec_p_min is not None and not 0.0 <= self.spec_p_min <= 1.0:
            raise InvalidRequestError(f"speculative.p_min must be in [0, 1], got {self.spec_p_min:g}")
        if self.repeat_last_n < -1:
            raise InvalidRequestError("repeat_last_n must be >= -1")
        if not 0 <= self.seed <= SEED_RANDOM:
            raise InvalidRequestError("seed must be in [0, 4294967295]")
        self.stop = tuple(s for s in self.stop if s)
        self.samplers = tuple(self.samplers)
        self.dry_sequence_breakers = tuple(self.dry_sequence_breakers)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature <= 0)."""
        return self.temperature <= 0.0


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > RequestStatus.PREEMPTED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # eos or stop word
    FINISHED_LENGTH = 4  # n_predict or context full
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


@dataclass(slots=True)
class TopLogprob:
    """One candidate token: id, its text piece, UTF-8 bytes and natural-log probability."""

    id: int
    token: str
    bytes: list[int]
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of a generated (or prompt) token plus its top candidates.

    With ``post_sampling_probs`` the values are probabilities after the sampler
    chain (still stored as natural logs; ``-inf`` when filtered out).
    """

    id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


@dataclass(slots=True)
class Timings:
    """llama-server's ``timings`` object (ms and token counts).

    ``predicted_per_token_ms`` and ``predicted_per_second`` count decode steps (generated tokens
    minus one): the first token comes from the prefill logits (llama-server's ``n_gen_steps``), so
    one generated token gives 0.0 for both; a rate whose divisor is 0 is 0.0, as llama-server's.

    ``draft_n`` / ``draft_n_accepted``: speculative decoding, tokens proposed and tokens of
    those the target model accepted (llama-server's fields; ``to_dict`` includes them only
    when something was proposed, as llama-server does).

    ``cache_miss`` (kvserve): why fewer prompt tokens were reused than a cached
    candidate offered (see ``Scheduler._diagnose``); None when nothing was
    missed. ``to_dict`` includes it only when present.
    """

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_miss: dict | None = None
    draft_n: int = 0
    draft_n_accepted: int = 0

    def to_dict(self) -> dict:
        """The JSON shape llama-server returns (per-token and per-second rates derived)."""
        steps = max(self.predicted_n - 1, 0)
        d = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n > 0 else 0.0,
            "prompt_per_second": (1e3 * self.prompt_n / self.prompt_ms) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": (1e3 * steps / self.predicted_ms) if self.predicted_ms > 0 else 0.0,
        }
        if self.draft_n > 0:
            d["draft_n"] = self.draft_n
            d["draft_n_accepted"] = self.draft_n_accepted
        if self.cache_miss is not None:
            d["cache_miss"] = dict(self.cache_miss)
        return d


def cache_key_of(cache_salt: str | None, lora: tuple[tuple[int, float], ...] = ()) -> str | None:
    """The prefix cache's extra key of a request's ``cache_salt`` and ``lora`` (``(adapter id, scale)``
    pairs): the salt alone without adapters, else ``"\\x00lora:ID@SCALE,...\\x00SALT"``. A salt that
    itself starts with NUL is written ``"\\x00salt:SALT"``, so no salt can name an adapter's key (a
    base request never reads KV computed under an adapter). :func:`split_cache_key` inverts it."""
    if not lora:
        return "\x00salt:" + cache_salt if cache_salt is not None and cache_salt.startswith("\x00") else cache_salt
    tag = ",".join(f"{aid}@{s!r}" for aid, s in lora)
    return f"\x00lora:{tag}\x00{cache_salt or ''}"


def split_cache_key(key: str | None) -> tuple[str | None, tuple[tuple[int, float], ...]]:
    """``(cache_salt, lora)`` of a key :func:`cache_key_of` made (scales exactly as given)."""
    if key is None:
        return None, ()
    if key.startswith("\x00salt:"):
        return key[len("\x00salt:"):], ()
    if key.startswith("\x00lora:"):
        tag, _, salt = key[len("\x00lora:"):].partition("\x00")
        pairs = (t.split("@", 1) for t in tag.split(","))
        return salt or None, tuple((int(a), float(s)) for a, s in pairs)
    return key, ()


@dataclass(slots=True)
class Request:
    """Everything the engine needs for one sequence, and its whole state.

    The scheduler moves it between queues; the KV cache manager owns its block
    table (looked up by ``request_id``). Faces build it and never touch it again.

    Attributes:
        request_id: unique string.
        prompt_token_ids: the prompt (list[int], token ids).
        params: SamplingParams.
        eog_token_ids: end-of-generation token ids (eos + template end-of-turn).
        grammar: optional output constraint (structured outputs), any object with
            this protocol (``kvserve.structured.backend.GrammarConstraint`` is one; a
            wrapper such as a reasoning-budget gate may be another):

            - ``mask() -> torch.Tensor | None``: called once per sampled token, before
              sampling; bool [n_vocab] (the logits' width), True = allowed, any device;
              None = no constraint at this position; never all False (the sampler
              raises SamplingError on an empty mask). End-of-generation ids are allowed
              only where the constrained text may end (only they, once it must end);
            - ``accept_token(token_id: int) -> bool``: called for each sampled token that
              is not an end-of-generation token; False means the token breaks the
              constraint (the engine then ends the request, stop_type "eos");
            - ``is_terminated() -> bool``: checked after each accepted token; True ends
              the request (stop_type "eos"), the token's text not emitted.

            A request with a constraint ends with stop_type "eos" when an
            end-of-generation token is sampled, even with ``ignore_eos`` (the sampler
            then only lets it through when nothing else is allowed).
        priority_slot: llama-server ``id_slot`` (-1 = any); used by the serving layer.
        cache_salt: extra key for the prefix cache (vLLM ``cache_salt``).
        lora: the LoRA adapters applied to this request's rows: ``(adapter id, scale)`` pairs of the
            engine's ``kvserve.lora.LoraRegistry`` (sorted by id, no zero scales: build it with
            ``LoraRegistry.resolve``); () = the base model. Part of the prefix cache's key
            (:attr:`cache_key`).
        owner: an opaque id of who sent the request (the faces: a digest of its API key; None: no
            key), used only to decide whose cached text ``cache_miss`` may show; not a cache key.
        cache_miss: set by the scheduler at admission (cache_miss diagnostics dict or None).
        num_draft_tokens, num_draft_accepted: speculative decoding counters (tokens proposed,
            tokens of those accepted), llama-server's ``draft_n`` / ``draft_n_accepted``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eog_token_ids: frozenset[int] = frozenset()
    grammar: object | None = None
    priority_slot: int = -1
    cache_salt: str | None = None
    owner: str | None = None
    lora: tuple[tuple[int, float], ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    return_progress: bool = False  # llama-server's return_progress: each prompt chunk yields a progress output
    # --- engine-owned state below ---
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1 = not scheduled yet)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_type: str = "none"
    stopping_word: str = ""
    cache_miss: dict | None = None
    num_draft_tokens: int = 0
    num_draft_accepted: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cache_key(self) -> str | None:
        """The prefix cache's extra key: ``cache_salt``, plus the LoRA adapters and their scales when
        any (seed 002: the block hash covers the adapter), so KV computed under one adapter (or
        scale) is reused only by requests under the same one (:func:`cache_key_of`)."""
        return cache_key_of(self.cache_salt, self.lora)

    @property
    def lora_ids(self) -> frozenset[int]:
        """The ids of the adapters this request applies."""
        return frozenset(aid for aid, _ in self.lora)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (what must be in the KV cache to sample the next one)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """Prompt processing so far (llama-server's ``prompt_progress``), on the output of a prompt
    chunk that sampled nothing, for a request with ``return_progress``.

    Attributes:
        total: prompt tokens.
        cache: prompt tokens reused from the KV cache.
        processed: prompt tokens in the KV now (cached ones included).
        time_ms: ms since the request's first chunk was scheduled (whole ms, as llama-server).
    """

    total: int
    cache: int
    processed: int
    time_ms: int


@dataclass(slots=True)
class RequestOutput:
    """One event of a request's output stream (one per engine step that produced something).

    Attributes:
        request_id: the request's id.
        new_token_ids: tokens generated in this step (usually one).
        text: new text, UTF-8 safe (never half a character, never a partial
            stop string).
        logprobs: one entry per new token when ``n_probs`` > 0, else None.
        prompt_logprobs: on the first event only, when asked for.
        finished: last event of this request.
        stop_type: "none" while running, then "eos" | "limit" | "word" | "abort".
        stopping_word: the stop string that ended generation (stop_type "word").
        finish_reason: OpenAI's name: None, "stop", "length" or "abort".
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens reused from the KV cache (cache_n).
        num_output_tokens: tokens generated so far.
        timings: llama-server timings so far.
        truncated: prompt plus output hit the context limit.
        error: message when the engine failed this request (finished is True).
        arrival_time: the request's ``arrival_time`` (``time.monotonic()`` seconds), for
            latency metrics measured from arrival (vLLM's time to first token, e2e latency).
        prompt_progress: set (and nothing else new) on a prompt chunk's output for a request
            with ``return_progress``; None otherwise.
        made_time: ``time.monotonic()`` seconds when the engine thread handed the output over
            (:class:`~kvserve.engine.async_engine.AsyncEngine`); 0.0 = not stamped. Latency
            metrics use it, not the time a face's loop got to the output.
        parts: on an output merged from several (a non-streamed request's outputs, delivered
            together: :meth:`merge`), one ``(made_time, number of new tokens, number of text
            characters)`` per engine output in it, in order; None on an output the engine made
            as it is. ``text`` and ``new_token_ids`` are the parts' concatenations.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    stop_type: str = "none"
    stopping_word: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    truncated: bool = False
    error: str | None = None
    arrival_time: float = 0.0
    prompt_progress: PromptProgress | None = None
    made_time: float = 0.0
    parts: list[tuple[float, int, int]] | None = None

    def merge(self, later: RequestOutput) -> None:
        """Append ``later`` (the same request's next output, not a prompt-progress one) to this
        one in place: tokens, text and logprobs concatenated (the first ``prompt_logprobs``
        kept), every other field ``later``'s; :attr:`parts` records both. Used on an output the
        caller owns (a copy), never on one the engine still holds."""
        if self.parts is None:
            self.parts = [(self.made_time, len(self.new_token_ids), len(self.text))]
        self.parts += later.parts or [(later.made_time, len(later.new_token_ids), len(later.text))]
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.stop_type, self.stopping_word = later.finished, later.stop_type, later.stopping_word
        self.num_prompt_tokens, self.num_cached_tokens = later.num_prompt_tokens, later.num_cached_tokens
        self.num_output_tokens, self.timings, self.truncated = later.num_output_tokens, later.timings, later.truncated
        self.error, self.made_time = later.error, later.made_time

    def part_texts(self) -> list[str]:
        """The text of each engine output merged into this one (:attr:`parts`), or ``[text]``."""
        if self.parts is None:
            return [self.text]
        texts, at = [], 0
        for _, _, n in self.parts:
            texts.append(self.text[at:at + n])
            at += n
        return texts

    @property
    def cache_miss(self) -> dict | None:
        """cache_miss diagnostics of the request (``timings.cache_miss``), None when nothing was missed."""
        return self.timings.cache_miss

    @property
    def finish_reason(self) -> str | None:
        if not self.finished:
            return None
        return {"eos": "stop", "word": "stop", "limit": "length"}.get(self.stop_type, self.stop_type)
