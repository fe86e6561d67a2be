"""``GET /metrics``: llama-server's ``llamacpp:`` metrics in Prometheus text format.

Names, HELP texts and TYPEs follow the seed's Example 15 (llama-server's
``handle_metrics``). Counters are cumulative since start; the rate gauges
(``prompt_tokens_seconds``, ``predicted_tokens_seconds``,
``n_busy_slots_per_decode``) are averaged over the window since the previous
scrape, so every scrape starts a new window.

The text is written here, not with prometheus-client: its Counter type appends
``_total`` (and ``_created`` samples) to names and would turn llama-server's
``llamacpp:n_tokens_max`` counter into ``llamacpp:n_tokens_max_total``; the
seed's names are the contract. The format is the 0.0.4 text exposition format.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvserve.engine.request import RequestOutput

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.manager import ModelManager
    from kvserve.serving.runner import Runner

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


def _fmt(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return f"{v:.6g}"


class Metrics:
    """One model's counters and the scrape window for its gauges.

    Args:
        state: the model's Runner (engine stats and slots are read from it).
    """

    def __init__(self, state: "Runner"):
        self._state = state
        self._lock = threading.Lock()
        self._last = {k: 0.0 for k in _WINDOW_KEYS}

    def on_output(self, out: RequestOutput) -> None:
        """Hook for per-output accounting (the engine's counters are the source of truth)."""

    def _values(self) -> dict[str, float]:
        state = self._state
        engine = state.engine
        st = engine.stats if engine is not None else None
        cur = {k: float(getattr(st, k, 0) or 0) for k in _WINDOW_KEYS}
        # reading the engine's plain counters from this thread is racy but harmless
        with self._lock:
            d = {k: cur[k] - self._last[k] for k in _WINDOW_KEYS}
            self._last = cur
        slots = state.slots
        # the engine counts reused prompt tokens when a request's first token is sampled
        cached = st.prompt_tokens_cached_total if st else 0
        return {
            "prompt_tokens_total": cur["prompt_tokens_total"],
            "prompt_tokens_cached_total": cached,
            "prompt_seconds_total": cur["prompt_seconds_total"],
            "tokens_predicted_total": cur["tokens_predicted_total"],
            "tokens_predicted_seconds_total": cur["tokens_predicted_seconds_total"],
            "n_decode_total": cur["n_decode_total"],
            "n_tokens_max": float(getattr(st, "n_tokens_max", 0) or 0),
            "spec_decode_num_draft_tokens_total": 0,
            "spec_decode_num_accepted_tokens_total": 0,
            "spec_decode_num_drafts_total": 0,
            "prompt_tokens_seconds": (d["prompt_tokens_total"] / d["prompt_seconds_total"]
                                      if d["prompt_seconds_total"] > 0 else 0.0),
            "predicted_tokens_seconds": (d["tokens_predicted_total"] / d["tokens_predicted_seconds_total"]
                                         if d["tokens_predicted_seconds_total"] > 0 else 0.0),
            "requests_processing": slots.n_busy if slots else 0,
            "requests_deferred": slots.n_deferred if slots else 0,
            "n_busy_slots_per_decode": (d["n_busy_slots_total"] / d["n_decode_total"]
                                        if d["n_decode_total"] > 0 else 0.0),
        }

    def render(self) -> str:
        """The exposition text, llama-server's exact lines; starts a new gauge window."""
        vals = self._values()
        lines = []
        for name, typ, help_ in _METRICS:
            full = f"llamacpp:{name}"
            lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}", f"{full} {_fmt(vals[name])}"]
        return "\n".join(lines) + "\n"


def render_empty() -> str:
    """llama-server's families with zero values (a model that is not loaded now)."""
    lines = []
    for name, typ, help_ in _METRICS:
        full = f"llamacpp:{name}"
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}", f"{full} 0"]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_models(manager: "ModelManager") -> str:
    """Several models (no ``-m``): each llama-server family once, one sample per loaded model
    labelled ``model="<name>"`` (vLLM labels its series by model too), then the manager's own
    series: models loaded, requests waiting for room, loads and unloads by reason."""
    runners = [e for e in manager.runners() if e.runner is not None and getattr(e.runner, "metrics", None)]
    values = [(e.name, e.runner.metrics._values()) for e in runners]
    lines = []
    for name, typ, help_ in _METRICS:
        full = f"llamacpp:{name}"
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {typ}"]
        lines += [f'{full}{{model="{_label(m)}"}} {_fmt(v[name])}' for m, v in values]
    st = manager.stats
    lines += ["# HELP kvserve:models_loaded Number of models loaded now.", "# TYPE kvserve:models_loaded gauge",
              f"kvserve:models_loaded {len(runners)}",
              "# HELP kvserve:model_requests_waiting Requests waiting for a model to make room.",
              "# TYPE kvserve:model_requests_waiting gauge", f"kvserve:model_requests_waiting {manager.waiting}",
              "# HELP kvserve:model_loads_total Models loaded since start.", "# TYPE kvserve:model_loads_total counter",
              f"kvserve:model_loads_total {st.loads}",
              "# HELP kvserve:model_load_failures_total Model loads that failed.",
              "# TYPE kvserve:model_load_failures_total counter", f"kvserve:model_load_failures_total {st.load_failures}",
              "# HELP kvserve:model_unloads_total Models unloaded, by reason.",
              "# TYPE kvserve:model_unloads_total counter"]
    lines += [f'kvserve:model_unloads_total{{reason="{_label(r)}"}} {n}' for r, n in sorted(st.unloads.items())]
    return "\n".join(lines) + "\n"
