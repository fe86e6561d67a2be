"""``GET /metrics``: llama-server's ``llamacpp:`` metrics in Prometheus text format.

Names, HELP texts and TYPEs follow the seed's Example 15 (llama-server's
``handle_metrics``). Counters are cumulative since start; the rate gauges
(``prompt_tokens_seconds``, ``predicted_tokens_seconds``,
``n_busy_slots_per_decode``) are averaged over the window since the previous
scrape, so every scrape starts a new window.

The counters outlive the runner, as llama-server's survive ``--sleep-idle-seconds``
(tools/server/tests/unit/test_sleep.py): when a runner closes, :meth:`Metrics.freeze` folds its
engine's totals into the object's base and stops reading the engine, so ``/metrics`` on a
sleeping model answers from that snapshot (the vLLM gauges keep the values read on freezing,
the llamacpp rates report what happened since the last scrape once, then 0). The server state
keeps the latest Metrics of each model (:class:`KeptMetrics`, at most :data:`MAX_KEPT_MODELS`
unloaded ones) and hands it to the next runner loaded for that name (:meth:`Metrics.attach`):
totals continue from the snapshot instead of restarting at 0. The page of several models
(``/metrics`` without ``?model=`` and without ``-m``, :func:`render_models`) lists every kept
model, loaded or not, so a counter never leaves the page while its model sleeps.

The text is written here, not with prometheus-client: its Counter type appends
``_total`` (and ``_created`` samples) to names and would turn llama-server's
``llamacpp:n_tokens_max`` counter into ``llamacpp:n_tokens_max_total``; the
seed's names are the contract. The format is the 0.0.4 text exposition format.

vLLM's ``vllm:`` metrics follow, on the same page (seed 002 Example 13; names, HELP texts,
types and buckets of vLLM's ``PrometheusStatLogger``, vllm/v1/metrics/loggers.py), written by
prometheus-client from one registry per model (so counters are ``*_total`` with ``*_created``
beside them, exactly as vLLM's page shows): every series has the labels ``model_name`` (the
served model name) and ``engine`` (``"0"``). The gauges are read when the page is scraped; the
counters and histograms are counted per request output as it reaches a face
(:meth:`Metrics.on_output`, called by :func:`kvserve.serving.chat_runner.generate` before the face
sees the output, so a response a client holds is always counted), with the times the engine
thread stamped on the outputs (``made_time``; a non-streamed request's merged output counts each
engine output in it, its ``parts``, as its own):

- ``vllm:prompt_tokens`` (the whole prompt, cached tokens included, once per request at its
  first token), ``vllm:generation_tokens``, ``vllm:request_success{finished_reason}`` (stop,
  length, error, repetition; ``abort``, a request whose client left, is counted by an engine
  step listener, since its last output reaches no face), ``vllm:num_preemptions`` (the
  engine's count);
- with ``--spec-type ngram``, vLLM's speculative-decoding counters from the engine's totals:
  ``vllm:spec_decode_num_drafts`` (verification runs), ``..._num_draft_tokens`` (proposed),
  ``..._num_accepted_tokens`` (accepted, the bonus token not counted) and
  ``..._num_accepted_tokens_per_pos{position}`` (0-based draft position);
- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: prompt tokens looked up / found
  in the prefix cache, once per request (vLLM counts again when a preempted request is
  rescheduled; kvserve does not);
- histograms: ``time_to_first_token_seconds`` (arrival to the first token),
  ``inter_token_latency_seconds`` (between a request's successive outputs with tokens: one
  observation per output after the first), ``e2e_request_latency_seconds`` (arrival to the
  final output), ``request_prompt_tokens`` and ``request_generation_tokens`` (per finished
  request; buckets 1-2-5 up to ``max_model_len``).

The periodic stats line of vLLM's ``LoggingStatLogger`` (``Engine 000: Avg prompt throughput:
...``) is logged every ``VLLM_LOG_STATS_INTERVAL`` seconds (default 10) while the model is busy
and once after it goes idle (debug otherwise); ``--disable-log-stats`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from kvserve.engine.request import RequestOutput

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.manager import ModelManager
    from kvserve.serving.chat_runner import Runner

#: llama-server's exact ``Content-Type`` of ``/metrics`` (no charset; the text is ASCII but for labels)
CONTENT_TYPE = "text/plain; version=0.0.4"
#: the process start, Unix seconds: llama-server's ``Process-Start-Time-Unix`` response header
#: (llama-server writes its monotonic start in µs there; kvserve writes what the name says)
PROCESS_START_UNIX = int(time.time())


def response_headers() -> dict[str, str]:
    """The headers of a ``/metrics`` answer (llama-server's): ``Content-Type`` and
    ``Process-Start-Time-Unix``."""
    return {"Content-Type": CONTENT_TYPE, "Process-Start-Time-Unix": str(PROCESS_START_UNIX)}


# (name, type, help) in llama-server's order
_METRICS = (
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Prompt process time"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "counter", "Predict process time"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls"),
    ("n_tokens_max", "counter", "Largest observed n_tokens."),
    ("spec_decode_num_draft_tokens_total", "counter", "Total number of draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter", "Total number of draft tokens accepted"),
    ("spec_decode_num_drafts_total", "counter", "Total number of draft sequences generated"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s."),
    ("requests_processing", "gauge", "Number of requests processing."),
    ("requests_deferred", "gauge", "Number of requests deferred."),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)

_WINDOW_KEYS = ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                "tokens_predicted_seconds_total", "n_decode_total", "n_busy_slots_total")
#: the engine's counters summed over a model's runners (``n_tokens_max``: the largest)
_TOTAL_KEYS = _WINDOW_KEYS + ("prompt_tokens_cached_total", "n_tokens_max", "spec_draft_tokens_total",
                              "spec_accepted_tokens_total", "spec_drafts_total")


def _fmt(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return f"{v:.6g}"


class Metrics:
    """One model's counters and the scrape window for its gauges: llama-server's ``llamacpp:``
    families and vLLM's ``vllm:`` ones (:class:`VllmMetrics`, made on first use).

    Args:
        runner: the model's Runner (engine stats and slots are read from it).

    Thread-safety: :meth:`on_output` and :meth:`render` run on the server's loop; the stats
    line is logged from a daemon thread (started with the first output unless
    ``--disable-log-stats``), which reads the vLLM counters under their lock.
    """

    def __init__(self, runner: Runner):
        self._runner = runner
        self._lock = threading.Lock()
        self._last = {k: 0.0 for k in _WINDOW_KEYS}
        self._vllm: VllmMetrics | None = None
        #: totals of the engines of earlier runners of this model (see :meth:`freeze`)
        self._base = dict.fromkeys(_TOTAL_KEYS, 0.0)
        self._base_per_pos: list[int] = []
        self._frozen = False
        self._listen(runner)

    def _listen(self, runner: Runner) -> None:
        listeners = getattr(runner.engine, "step_listeners", None)
        if isinstance(listeners, list):  # a generative engine: aborted requests are seen there
            listeners.append(self._on_step)

    @property
    def frozen(self) -> bool:
        """True between :meth:`freeze` and :meth:`attach`: the model is not loaded."""
        return self._frozen

    def freeze(self) -> None:
        """The runner is closing (called before its engine stops): fold the engine's totals
        into the base, read the vLLM gauges one last time, and stop reading the engine.
        Idempotent. Thread-safe (runs in the unloading worker thread)."""
        if self._frozen:
            return
        if self._vllm is not None:
            self._vllm.freeze()
        with self._lock:
            self._base = self._totals_locked()
            self._base_per_pos = self._per_pos_locked()
            self._frozen = True

    def attach(self, runner: Runner) -> None:
        """Continue counting on ``runner`` (a new load of this model): it takes over this
        object as ``runner.metrics``, the engine's counters add to the kept totals, and the
        gauge window goes on from the last scrape (so a wake does not report rates again).

        Raises:
            RuntimeError: this Metrics is not frozen (its runner is still loaded).
        """
        if not self._frozen:
            raise RuntimeError("Metrics.attach: the previous runner is still loaded")
        fresh = getattr(runner, "metrics", None)
        listeners = getattr(runner.engine, "step_listeners", None)
        if fresh is not None and isinstance(listeners, list) and fresh._on_step in listeners:
            listeners.remove(fresh._on_step)
        with self._lock:
            self._runner = runner
            self._frozen = False
        self._listen(runner)
        if self._vllm is not None:
            self._vllm.attach(runner)
        runner.metrics = self

    def _totals_locked(self) -> dict[str, float]:
        """Counters since start: the base plus the live engine's (caller holds the lock)."""
        if self._frozen:
            return dict(self._base)
        engine = self._runner.engine
        st = engine.stats if engine is not None else None
        out = {}
        for k in _TOTAL_KEYS:  # reading the engine's plain counters from this thread is racy but harmless
            v = float(getattr(st, k, 0) or 0)
            out[k] = max(self._base[k], v) if k == "n_tokens_max" else self._base[k] + v
        return out

    def _per_pos_locked(self) -> list[int]:
        if self._frozen:
            return list(self._base_per_pos)
        engine = self._runner.engine
        st = engine.stats if engine is not None else None
        live = [int(v) for v in (getattr(st, "spec_accepted_per_pos", ()) or ())]
        base = self._base_per_pos
        return [(base[i] if i < len(base) else 0) + (live[i] if i < len(live) else 0)
                for i in range(max(len(base), len(live)))]

    @property
    def vllm(self) -> VllmMetrics:
        """This model's vLLM metrics (built on first use: the served name is known by then)."""
        if self._vllm is None:
            with self._lock:
                if self._vllm is None:
                    self._vllm = VllmMetrics(self._runner)
        return self._vllm

    def _on_step(self, core, outputs: list[RequestOutput]) -> None:
        """Engine-thread step listener: a request aborted because its client left ends with an
        output no face receives; count it here (``request_success{finished_reason="abort"}``)."""
        for out in outputs:
            if out.finished and out.stop_type == "abort" and not out.error:
                self.vllm.on_abort(out)

    def on_output(self, out: RequestOutput) -> None:
        """Count one request output (the engine's counters stay the source of the llamacpp:
        families; the vLLM ones are counted here, see the module docstring)."""
        self.vllm.on_output(out)

    def _values(self) -> dict[str, float]:
        with self._lock:
            cur = self._totals_locked()
            d = {k: cur[k] - self._last[k] for k in _WINDOW_KEYS}
            self._last = {k: cur[k] for k in _WINDOW_KEYS}
        slots = None if self._frozen else self._runner.slots
        return {
            "prompt_tokens_total": cur["prompt_tokens_total"],
            # the engine counts reused prompt tokens when a request's first token is sampled
            "prompt_tokens_cached_total": cur["prompt_tokens_cached_total"],
            "prompt_seconds_total": cur["prompt_seconds_total"],
            "tokens_predicted_total": cur["tokens_predicted_total"],
            "tokens_predicted_seconds_total": cur["tokens_predicted_seconds_total"],
            "n_decode_total": cur["n_decode_total"],
            "n_tokens_max": cur["n_tokens_max"],
            # speculative decoding (--spec-type ngram): the engine's totals, 0 without it
            "spec_decode_num_draft_tokens_total": cur["spec_draft_tokens_total"],
            "spec_decode_num_accepted_tokens_total": cur["spec_accepted_tokens_total"],
            "spec_decode_num_drafts_total": cur["spec_drafts_total"],
            "prompt_tokens_seconds": (d["prompt_tokens_total"] / d["prompt_seconds_total"]
                                      if d["prompt_seconds_total"] > 0 else 0.0),
            "predicted_tokens_seconds": (d["tokens_predicted_total"] / d["tokens_predicted_seconds_total"]
                                         if d["tokens_predicted_seconds_total"] > 0 else 0.0),
            "requests_processing": slots.n_busy if slots else 0,
            "requests_deferred": slots.n_deferred if slots else 0,
            "n_busy_slots_per_decode": (d["n_busy_slots_total"] / d["n_decode_total"]
                                        if d["n_decode_total"] > 0 else 0.0),
        }

    def accepted_per_pos(self) -> list[int]:
        """Draft tokens accepted at each draft position (0-based) since start (earlier runners'
        included); [] without speculative decoding."""
        with self._lock:
            return self._per_pos_locked()

    def render(self) -> str:
        """The exposition text: llama-server's exact lines, then vLLM's families; starts a new
        gauge window. With speculative decoding, llama-server's per-position counter
        ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` (exact integers)
        ends the llamacpp block (omitted while empty, as llama-server does; the HELP text is
        kvserve's)."""
        vals = self._values()
        lines = []
        for name, typ, help_ in _METRICS:
            full = f"llamacpp:{name}"
            lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}", f"{full} {_fmt(vals[name])}"]
        lines += _per_pos_lines(self.accepted_per_pos())
        return "\n".join(lines) + "\n" + self.vllm.render()


_PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"


def _per_pos_lines(per_pos: list[int]) -> list[str]:
    if not per_pos:
        return []
    return ([f"# HELP {_PER_POS} Number of draft tokens accepted at each draft position",
             f"# TYPE {_PER_POS} counter"] + [f'{_PER_POS}{{position="{i}"}} {n}' for i, n in enumerate(per_pos)])


def render_empty() -> str:
    """llama-server's families with zero values (a model that is not loaded now)."""
    lines = []
    for name, typ, help_ in _METRICS:
        full = f"llamacpp:{name}"
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}", f"{full} 0"]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


#: models whose counters :class:`KeptMetrics` keeps at most (beyond it, the unloaded model kept
#: longest ago is dropped; a loaded model is never dropped)
MAX_KEPT_MODELS = 64


class KeptMetrics:
    """Each model's latest :class:`Metrics`, by served name: what ``/metrics`` answers from while a
    model sleeps or is unloaded, and what the next runner of that name continues counting on.

    Bounded: at most ``cap`` models (:data:`MAX_KEPT_MODELS`) plus any that are loaded; keeping
    one more drops the unloaded (frozen) model whose runner loaded longest ago, so a server that
    loads many models in turn keeps the counters of the ``cap`` most recent. A dropped model's
    series leave the page, and count from 0 if it loads again (a counter reset to Prometheus).

    Thread-safety: used on the server's event loop only.
    """

    def __init__(self, cap: int = MAX_KEPT_MODELS):
        if cap < 1:
            raise ValueError("KeptMetrics: cap must be >= 1")
        self.cap = cap
        self._by_name: OrderedDict[str, Metrics] = OrderedDict()  # least recently loaded first

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Metrics | None:
        """``name``'s Metrics (loaded or frozen), else None."""
        return self._by_name.get(name)

    def keep(self, name: str, runner: Runner) -> None:
        """A runner of ``name`` has loaded: it continues the counters its previous runner left
        (:meth:`Metrics.attach`, llama-server keeps its metrics through sleep), else its own
        Metrics are kept; then the bound is applied."""
        metrics = getattr(runner, "metrics", None)
        if metrics is None:
            return
        kept = self._by_name.get(name)
        if kept is not None and kept is not metrics and kept.frozen:
            kept.attach(runner)
        else:
            self._by_name[name] = metrics
        self._by_name.move_to_end(name)
        self._evict()

    def _evict(self) -> None:
        over = len(self._by_name) - self.cap
        for name in [n for n, m in self._by_name.items() if m.frozen][:max(over, 0)]:
            del self._by_name[name]

    def models(self) -> list[tuple[str, Metrics]]:
        """``(served name, Metrics)`` of every kept model, loaded or not, sorted by name."""
        return sorted(self._by_name.items())


def render_models(manager: ModelManager, kept: KeptMetrics) -> str:
    """Several models (no ``-m``): each llama-server family once, one sample per model labelled
    ``model="<name>"`` (vLLM labels its series by model too), then the manager's own series:
    models loaded, requests waiting for room, loads and unloads by reason.

    The models listed are those ``kept`` holds, loaded or not: a model that slept or was
    unloaded keeps its series, its counters held at their last values (Prometheus counters stay
    monotonic: a series that vanished and came back would read as a gap or a reset to
    ``rate()``), its gauges 0; they continue when it loads again, as llama-server's counters
    survive its sleep. A loaded model's vLLM series are listed; an unloaded one's only when it
    had built them (it ran a request or was scraped)."""
    listed = kept.models()
    values = [(name, m._values()) for name, m in listed]
    lines = []
    for name, typ, help_ in _METRICS:
        full = f"llamacpp:{name}"
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}"]
        lines += [f'{full}{{model="{_label(m)}"}} {_fmt(v[name])}' for m, v in values]
    st = manager.stats
    lines += ["# HELP kvserve:models_loaded Number of models loaded now.", "# TYPE kvserve:models_loaded gauge",
              f"kvserve:models_loaded {len(manager.runners())}",
              "# HELP kvserve:model_requests_waiting Requests waiting for a model to make room.",
              "# TYPE kvserve:model_requests_waiting gauge", f"kvserve:model_requests_waiting {manager.waiting}",
              "# HELP kvserve:model_loads_total Models loaded since start.", "# TYPE kvserve:model_loads_total counter",
              f"kvserve:model_loads_total {st.loads}",
              "# HELP kvserve:model_load_failures_total Model loads that failed.",
              "# TYPE kvserve:model_load_failures_total counter", f"kvserve:model_load_failures_total {st.load_failures}",
              "# HELP kvserve:model_unloads_total Models unloaded, by reason.",
              "# TYPE kvserve:model_unloads_total counter"]
    lines += [f'kvserve:model_unloads_total{{reason="{_label(r)}"}} {n}' for r, n in sorted(st.unloads.items())]
    vllm = [m.vllm if not m.frozen else m._vllm for _, m in listed]
    return "\n".join(lines) + "\n" + render_vllm([v for v in vllm if v is not None])


# -- vLLM's metrics ---------------------------------------------------------------------------

log = logging.getLogger("kvserve.server")

#: vLLM's FinishReason values (vllm/v1/engine/__init__.py), each a pre-made series
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")
#: requests in flight whose latency state is kept; beyond it the oldest are forgotten (a client
#: that disconnects leaves its request's entry behind: its final output never reaches a face)
MAX_TRACKED = 4096
#: vLLM's PrefixCachingMetrics window: the hit rate of the stats line covers the last N requests
HIT_RATE_REQUESTS = 1000


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's bucket rule for token counts)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


def _finish_reason(out: RequestOutput) -> str:
    if out.error:
        return "error"
    if out.stop_type == "limit":
        return "length"
    if out.stop_type == "abort":
        return "abort"
    return "stop"


def log_interval_s() -> float:
    """``VLLM_LOG_STATS_INTERVAL`` seconds (default 10, as vLLM); at least 0.1."""
    try:
        return max(0.1, float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")))
    except ValueError:
        return 10.0


class _Tracked:
    """One request in flight: whether its first token came, when its last output came."""

    __slots__ = ("first", "last")

    def __init__(self) -> None:
        self.first = False
        self.last = 0.0


class VllmMetrics:
    """One model's ``vllm:`` families (see the module docstring) and its stats-line window.

    Args:
        runner: the model's Runner (served name, engine, slots, args).
    """

    def __init__(self, runner: Runner):
        self._runner = runner
        engine = runner.engine
        self.model_name = str(getattr(runner, "model_alias", "") or getattr(getattr(runner, "spec", None), "name", ""))
        self.max_model_len = int(getattr(engine, "n_ctx_slot", 0) or 0) if engine is not None else 0
        # prometheus-client (and the http.server it brings) loads with the first vLLM families, not at start-up
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()
        r, lv = self.registry, (self.model_name, "0")

        def gauge(name: str, doc: str):
            return Gauge(name, doc, LABELS, registry=r).labels(*lv)

        def counter(name: str, doc: str):
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ("finished_reason",), registry=r)
        self.success = {k: success.labels(*lv, k) for k in FINISH_REASONS}
        lens = build_1_2_5_buckets(max(self.max_model_len, 1))
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lens)
        self.req_generation_tokens = histogram("vllm:request_generation_tokens",
                                               "Number of generation tokens processed.", lens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self._preempted_seen = 0
        # speculative decoding (vLLM's SpecDecodingProm): only on an engine that speculates
        core = getattr(engine, "core", None)  # a generative engine's; an encoder's engine has none
        spec_on = core is not None and core.config.spec.method is not None
        self.spec = None
        if spec_on:
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", LABELS + ("position",), registry=r)
            self.spec = {
                "spec_drafts_total": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                "spec_draft_tokens_total": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                "spec_accepted_tokens_total": counter("vllm:spec_decode_num_accepted_tokens",
                                                      "Number of accepted tokens."),
            }
            self._spec_per_pos = per_pos
            self._spec_seen: dict[str, int] = dict.fromkeys(self.spec, 0)
            self._spec_pos_seen: list[int] = []
        # the stats line: tokens since the last line, the hit rate over the last requests
        self._win_prompt = self._win_gen = 0
        self._win_start = time.monotonic()
        self._last_tp = (0.0, 0.0)
        self._recent: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_REQUESTS)
        self._recent_q = self._recent_h = 0
        self._logger_started = False
        self._frozen = False

    # -- counting ---------------------------------------------------------------------------

    def on_output(self, out: RequestOutput) -> None:
        """Count one output of a request (see the module docstring for what each family counts)."""
        if out.finished and out.stop_type == "abort" and not out.error:
            return  # counted by the engine's step listener (:meth:`on_abort`)
        # times are the engine thread's (made_time), one per engine output a merged output holds
        parts = out.parts or ((out.made_time or time.monotonic(), len(out.new_token_ids), 0),)
        now = parts[-1][0]
        arrival = out.arrival_time or now
        last_part = len(parts) - 1
        with self._lock:
            t = self._tracked.get(out.request_id)
            if t is None:
                t = self._tracked[out.request_id] = _Tracked()
                while len(self._tracked) > MAX_TRACKED:
                    self._tracked.popitem(last=False)
            for k, (when, n_new, _) in enumerate(parts):
                first_now = not t.first and (n_new > 0 or (out.finished and k == last_part
                                                           and out.timings.prompt_ms > 0))
                if first_now:  # the prompt was processed: its tokens and cache lookups count once
                    t.first = True
                    self.ttft.observe(max(0.0, when - arrival))
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                    self.prefix_queries.inc(out.num_prompt_tokens)
                    self.prefix_hits.inc(out.num_cached_tokens)
                    self._win_prompt += out.num_prompt_tokens
                    self._hit_rate_add(out.num_prompt_tokens, out.num_cached_tokens)
                elif n_new > 0:
                    self.itl.observe(max(0.0, when - t.last))
                if n_new:
                    self.generation_tokens.inc(n_new)
                    self._win_gen += n_new
                    t.last = when
            if out.finished:
                self._tracked.pop(out.request_id, None)
                self.success[_finish_reason(out)].inc()
                self.e2e.observe(max(0.0, now - arrival))
                self.req_prompt_tokens.observe(out.num_prompt_tokens)
                self.req_generation_tokens.observe(out.num_output_tokens)
        if not self._logger_started:
            self._start_logger()

    def on_abort(self, out: RequestOutput) -> None:
        """An aborted request's final output, from the engine thread: ``abort`` once, its
        latency state dropped (whether or not a face also sees the output)."""
        with self._lock:
            self._tracked.pop(out.request_id, None)
            self.success["abort"].inc()

    def _hit_rate_add(self, queries: int, hits: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            q, h = self._recent[0]
            self._recent_q -= q
            self._recent_h -= h
        self._recent.append((queries, hits))
        self._recent_q += queries
        self._recent_h += hits

    # -- gauges and the page ----------------------------------------------------------------

    def scheduler_state(self) -> tuple[int, int, float]:
        """``(running, waiting, kv usage 0..1)`` now: requests in the engine's batch; requests
        in its queue plus those waiting for a slot (llama-server's deferred ones); the
        fraction of KV blocks held by sequences and idle slots."""
        runner = self._runner
        slots = getattr(runner, "slots", None)
        deferred = slots.n_deferred if slots else 0  # none: a remote model (kvserve.remote)
        try:  # the runner protocol's engine_counts: plain reads of the engine thread's containers
            running, queued, usage = runner.engine_counts()
        except Exception:  # noqa: BLE001 - a closing engine
            return 0, deferred, 0.0
        return running, queued + deferred, usage

    def _refresh(self) -> None:
        if self._frozen:
            return
        running, waiting, usage = self.scheduler_state()
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(usage)
        engine = self._runner.engine
        st = getattr(engine, "stats", None)
        n = int(getattr(st, "num_preemptions", 0) or 0)
        with self._lock:
            if n > self._preempted_seen:
                self.preemptions.inc(n - self._preempted_seen)
                self._preempted_seen = n
            if self.spec is not None and st is not None:  # the engine's totals -> counter increments
                for key, c in self.spec.items():
                    v = int(getattr(st, key, 0) or 0)
                    if v > self._spec_seen[key]:
                        c.inc(v - self._spec_seen[key])
                        self._spec_seen[key] = v
                per_pos = list(getattr(st, "spec_accepted_per_pos", ()) or ())
                for i, v in enumerate(per_pos):
                    seen = self._spec_pos_seen[i] if i < len(self._spec_pos_seen) else 0
                    if v > seen:
                        self._spec_per_pos.labels(self.model_name, "0", str(i)).inc(v - seen)
                self._spec_pos_seen = per_pos

    def render(self) -> str:
        """This model's ``vllm:`` families in the text format (gauges read now; while frozen,
        the values read on freezing)."""
        self._refresh()
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")

    def freeze(self) -> None:
        """The runner is closing: read the gauges and engine totals one last time, then keep
        them (:meth:`_refresh` does nothing until :meth:`attach`)."""
        self._refresh()
        self._frozen = True

    def attach(self, runner: Runner) -> None:
        """Count on ``runner`` (a new load): its engine's totals start at 0 again, so the
        increments seen so far restart; the stats-line logger starts with its first output."""
        with self._lock:
            self._runner = runner
            self._preempted_seen = 0
            if self.spec is not None:
                self._spec_seen = dict.fromkeys(self.spec, 0)
                self._spec_pos_seen = []
            self._frozen = False
            self._logger_started = False

    # -- the stats line -----------------------------------------------------------------------

    def stats_line(self) -> tuple[str, bool]:
        """vLLM's ``LoggingStatLogger`` line over the window since the previous call, and
        whether it is worth INFO (some throughput now or in the previous window); starts a
        new window."""
        now = time.monotonic()
        running, waiting, usage = self.scheduler_state()
        with self._lock:
            dt = now - self._win_start
            prompt_tp = self._win_prompt / dt if dt > 0 else 0.0
            gen_tp = self._win_gen / dt if dt > 0 else 0.0
            self._win_prompt = self._win_gen = 0
            self._win_start = now
            hit = self._recent_h / self._recent_q if self._recent_q else 0.0
            busy = any((prompt_tp, gen_tp) + self._last_tp)
            self._last_tp = (prompt_tp, gen_tp)
        line = (f"Engine 000: Avg prompt throughput: {prompt_tp:.1f} tokens/s, Avg generation throughput: "
                f"{gen_tp:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, {self._kv_label()}: "
                f"{usage * 100:.1f}%, Prefix cache hit rate: {hit * 100:.1f}%")
        return line, busy

    def _kv_label(self) -> str:
        """vLLM's ``GPU KV cache usage`` where the KV cache is on a GPU, ``KV cache usage`` on a CPU."""
        device = getattr(getattr(getattr(self._runner, "engine", None), "core", None), "device", None)
        return "GPU KV cache usage" if getattr(device, "type", "cpu") != "cpu" else "KV cache usage"

    def log_stats(self) -> None:
        """Log :meth:`stats_line` (INFO while busy, DEBUG when idle, as vLLM)."""
        line, busy = self.stats_line()
        log.log(logging.INFO if busy else logging.DEBUG, "%s", line, extra={"func": "loggers.py"})

    def _start_logger(self) -> None:
        self._logger_started = True
        if getattr(getattr(self._runner, "args", None), "disable_log_stats", False):
            return
        threading.Thread(target=_log_loop, args=(weakref.ref(self), self._runner, log_interval_s()),
                         name=f"kvserve-stats-log:{self.model_name}", daemon=True).start()


def _log_loop(ref: weakref.ref[VllmMetrics], runner: Runner, interval: float) -> None:
    """Log the stats line every ``interval`` seconds until ``runner`` is unloaded."""
    runner = weakref.ref(runner) if _weakrefable(runner) else (lambda r=runner: r)
    while True:
        time.sleep(interval)
        m = ref()
        if m is None or m._runner is not runner() or m._runner.engine is None:
            return
        try:
            m.log_stats()
        except Exception:
            log.exception("stats log line failed", extra={"func": "loggers.py"})
        del m


def _weakrefable(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


class _Merged:
    """Several models' registries as one collector: each family once, every model's samples."""

    def __init__(self, registries):
        self._registries = registries

    def collect(self):
        fams: dict[str, object] = {}
        for reg in self._registries:
            for f in reg.collect():
                if f.name in fams:
                    fams[f.name].samples.extend(f.samples)
                else:
                    fams[f.name] = f
        return list(fams.values())


def render_vllm(models: list[VllmMetrics]) -> str:
    """The ``vllm:`` families of several models (no ``-m``): each family once, one series per
    model (its ``model_name`` label), as one vLLM page lists several engines."""
    for m in models:
        m._refresh()
    if not models:
        return ""
    from prometheus_client import generate_latest

    return generate_latest(_Merged([m.registry for m in models])).decode("utf-8")
