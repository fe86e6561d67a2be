"""The metrics kept per model (kvserve.serving.metrics.KeptMetrics) and the page of several models
(render_models), on stand-in runners: the bound (the unloaded model loaded longest ago goes first,
a loaded one never), a reload continuing the kept counters, and an unloaded model's counters
staying on the combined page with their last values while ``kvserve:models_loaded`` counts only
the loaded ones."""

from __future__ import annotations

import types

import pytest

from kvserve.engine.core import EngineStats
from kvserve.serving.manager import ManagerStats
from kvserve.serving.metrics import MAX_KEPT_MODELS, KeptMetrics, Metrics, render_models


def _runner(name: str, **stats) -> types.SimpleNamespace:
    engine = types.SimpleNamespace(stats=EngineStats(**stats), step_listeners=[], n_ctx_slot=256)
    r = types.SimpleNamespace(engine=engine, slots=None, model_alias=name, args=None,
                              spec=types.SimpleNamespace(name=name), engine_counts=lambda: (0, 0, 0.0))
    r.metrics = Metrics(r)
    return r


def _unload(r) -> None:
    r.metrics.freeze()
    r.engine = None


def _load(kept: KeptMetrics, name: str, **stats):
    r = _runner(name, **stats)
    kept.keep(name, r)
    return r


def test_the_unloaded_model_loaded_longest_ago_goes_first():
    kept = KeptMetrics(cap=2)
    a, b = _load(kept, "a"), _load(kept, "b")
    _unload(a)
    _unload(b)
    c = _load(kept, "c")  # over the cap: a (unloaded, loaded first) is dropped
    assert [n for n, _ in kept.models()] == ["b", "c"] and kept.get("a") is None
    a2 = _load(kept, "a")  # a again: its counters start over; b is dropped
    assert [n for n, _ in kept.models()] == ["a", "c"] and kept.get("a") is a2.metrics
    assert kept.get("c") is c.metrics and len(kept) == 2


def test_a_loaded_model_is_never_dropped():
    kept = KeptMetrics(cap=1)
    a, b = _load(kept, "a"), _load(kept, "b")
    assert len(kept) == 2  # both loaded: over the cap until one unloads
    _unload(a)
    _load(kept, "c")
    assert [n for n, _ in kept.models()] == ["b", "c"]
    assert kept.get("b") is b.metrics and MAX_KEPT_MODELS == 64
    with pytest.raises(ValueError):
        KeptMetrics(cap=0)


def test_a_reload_continues_the_kept_counters_and_refreshes_its_age():
    kept = KeptMetrics(cap=2)
    a = _load(kept, "a", tokens_predicted_total=7)
    first = a.metrics
    _unload(a)
    b = _load(kept, "b")
    _unload(b)
    a2 = _load(kept, "a", tokens_predicted_total=5)  # the same Metrics object counts on
    assert a2.metrics is first and kept.get("a") is first
    assert first._values()["tokens_predicted_total"] == 12
    _unload(a2)
    _load(kept, "c")  # b is now the oldest unloaded
    assert [n for n, _ in kept.models()] == ["a", "c"]


def test_the_combined_page_keeps_unloaded_models_counters():
    kept = KeptMetrics()
    a = _load(kept, "sleepy", prompt_tokens_total=11, tokens_predicted_total=4, n_decode_total=4)
    b = _load(kept, "awake", prompt_tokens_total=3)
    _unload(a)
    manager = types.SimpleNamespace(runners=lambda: [types.SimpleNamespace(name="awake", runner=b)], waiting=0,
                                    stats=ManagerStats(loads=2, unloads={"keep_alive": 1}))
    page = render_models(manager, kept)
    lines = page.splitlines()
    assert 'llamacpp:prompt_tokens_total{model="sleepy"} 11' in lines
    assert 'llamacpp:tokens_predicted_total{model="sleepy"} 4' in lines
    assert 'llamacpp:requests_processing{model="sleepy"} 0' in lines
    assert 'llamacpp:prompt_tokens_total{model="awake"} 3' in lines
    # one sample per model, in name order, under one HELP/TYPE pair
    i = lines.index("# TYPE llamacpp:prompt_tokens_total counter")
    assert lines[i + 1:i + 3] == ['llamacpp:prompt_tokens_total{model="awake"} 3',
                                  'llamacpp:prompt_tokens_total{model="sleepy"} 11']
    assert "kvserve:models_loaded 1" in lines and "kvserve:model_loads_total 2" in lines
    assert 'kvserve:model_unloads_total{reason="keep_alive"} 1' in lines
    # the loaded model's vLLM series are listed; the unloaded one never built any
    assert 'vllm:num_requests_running{engine="0",model_name="awake"} 0.0' in lines
    assert not any('model_name="sleepy"' in line for line in lines)
    again = render_models(manager, kept).splitlines()  # a second scrape: the counters hold
    assert 'llamacpp:prompt_tokens_total{model="sleepy"} 11' in again
