"""Metrics that outlive a runner (kvserve.serving.metrics: freeze / attach), on stand-in runners:
exact totals across two engines, the speculative per-position counters summed, ``n_tokens_max``
the larger, the step listener moved to the kept object."""

from __future__ import annotations

import types

import pytest

from kvserve.engine.core import EngineStats
from kvserve.serving.metrics import Metrics


def _runner(**stats) -> types.SimpleNamespace:
    engine = types.SimpleNamespace(stats=EngineStats(**stats), step_listeners=[])
    return types.SimpleNamespace(engine=engine, slots=None, model_alias="m", args=None)


def test_totals_continue_across_runners_and_the_snapshot_holds_while_frozen():
    a = _runner(prompt_tokens_total=5, tokens_predicted_total=4, tokens_predicted_seconds_total=2.0,
                n_decode_total=4, n_tokens_max=9, spec_accepted_per_pos=[3, 1])
    m = Metrics(a)
    assert a.engine.step_listeners == [m._on_step]
    v = m._values()
    assert (v["tokens_predicted_total"], v["predicted_tokens_seconds"], v["n_decode_total"]) == (4, 2.0, 4)
    a.engine.stats.tokens_predicted_total += 2  # generated after the last scrape, before the sleep
    a.engine.stats.tokens_predicted_seconds_total += 0.5
    m.freeze()
    a.engine = None  # the runner closed
    assert m.frozen
    v = m._values()  # the window up to the sleep is reported once, then 0
    assert (v["tokens_predicted_total"], v["predicted_tokens_seconds"]) == (6, 4.0)
    v = m._values()
    assert (v["tokens_predicted_total"], v["predicted_tokens_seconds"], v["prompt_tokens_total"]) == (6, 0.0, 5)
    assert m.accepted_per_pos() == [3, 1]

    b = _runner(n_tokens_max=7, spec_accepted_per_pos=[2, 0, 1])
    b.metrics = Metrics(b)
    m.attach(b)
    assert b.metrics is m and not m.frozen and b.engine.step_listeners == [m._on_step]
    v = m._values()  # nothing ran since the last scrape: no rate reported again
    assert (v["tokens_predicted_total"], v["predicted_tokens_seconds"], v["n_tokens_max"]) == (6, 0.0, 9)
    b.engine.stats.tokens_predicted_total = 3
    b.engine.stats.prompt_tokens_total = 5
    b.engine.stats.n_tokens_max = 12
    v = m._values()
    assert (v["tokens_predicted_total"], v["prompt_tokens_total"], v["n_tokens_max"]) == (9, 10, 12)
    assert m.accepted_per_pos() == [5, 1, 1]


def test_attach_refuses_while_the_runner_is_loaded():
    m = Metrics(_runner())
    with pytest.raises(RuntimeError, match="still loaded"):
        m.attach(_runner())
