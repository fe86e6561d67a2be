"""The grammar warm-up after a load waits for an idle engine (kvserve.serving.chat_runner._warm_grammars): the first
requests after /health do not share the cores with xgrammar's import."""

from __future__ import annotations

import threading
import time

from kvserve.serving import chat_runner as runner_mod


class _Slots:
    def __init__(self):
        self.n_busy = 0
        self.n_deferred = 0


class _Grammars:
    def __init__(self):
        self.built = threading.Event()

    def _get_compiler(self):
        self.built.set()


class _Runner:
    def __init__(self):
        self.slots = _Slots()
        self.grammars = _Grammars()
        self.engine = object()


def test_wait_idle_waits_for_quiet_slots():
    r = _Runner()
    r.slots.n_busy = 1
    done = []
    t = threading.Thread(target=lambda: done.append(runner_mod._wait_idle(r, 0.2, 30.0, poll_s=0.01)))
    t.start()
    time.sleep(0.4)
    assert done == []  # a request runs: no warm-up
    r.slots.n_busy, r.slots.n_deferred = 0, 1
    time.sleep(0.4)
    assert done == []  # one waits for a slot: still none
    r.slots.n_deferred = 0
    t0 = time.monotonic()
    t.join(5)
    assert done == [True] and time.monotonic() - t0 >= 0.15


def test_wait_idle_gives_up_when_closed_or_busy_too_long():
    r = _Runner()
    r.slots.n_busy = 1
    t0 = time.monotonic()
    assert runner_mod._wait_idle(r, 0.1, 0.3, poll_s=0.01) is False
    assert 0.3 <= time.monotonic() - t0 < 3
    r.engine = None
    assert runner_mod._wait_idle(r, 0.1, 30.0, poll_s=0.01) is False


def test_warm_grammars_builds_once_idle_and_not_for_a_closed_runner():
    r = _Runner()
    runner_mod._warm_grammars(r, None, idle_s=0.05, wait_max_s=5.0)
    assert r.grammars.built.is_set()
    closed = _Runner()
    g = closed.grammars
    closed.engine = closed.grammars = closed.slots = None
    runner_mod._warm_grammars(closed, None, idle_s=0.05, wait_max_s=5.0)
    assert not g.built.is_set()
