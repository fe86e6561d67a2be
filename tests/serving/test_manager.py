"""The model manager under a fake clock and a fake loader (no model, milliseconds)."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from kvserve.errors import ServerFaultError, UnavailableError
from kvserve.serving.manager import (
    MIB,
    MemoryEstimate,
    ModelManager,
    ModelSpec,
    estimate_memory,
    format_keep_alive,
    parse_keep_alive,
)

# seed 004 Example 2, its output verbatim
SEED_TRACE = """\
t=  0s load   coder:7b
t= 30s load   embed
t= 31s unload embed (keep_alive 0)
t= 40s load   chat:8b
t= 60s load   vision
t= 70s unload coder:7b (make room)
t= 70s load   draft:1b
t=400s unload vision (keep_alive elapsed)
t=400s unload draft:1b (keep_alive elapsed)
t=400s load   coder:7b
loaded at t=400s: [chat:8b, coder:7b]"""


class FakeRunner:
    def __init__(self, name: str, size: int = 0):
        self.name = name
        self.closed = False
        self.measured_bytes = size

    def close(self) -> None:
        self.closed = True


class Harness:
    """Drives a ModelManager with a fake clock; records its events in the seed's shape."""

    def __init__(self, **kw):
        self.now = 0.0
        self.lines: list[str] = []
        self.runners: dict[str, FakeRunner] = {}
        self.loader = kw.pop("loader", self._load)
        self.m = ModelManager(self.loader, clock=lambda: self.now, on_event=self._event, **kw)
        self.leases: dict[str, list] = {}

    def _load(self, spec: ModelSpec) -> FakeRunner:
        r = self.runners[spec.name] = FakeRunner(spec.name)
        return r

    def _event(self, t, action, name, reason):
        if action == "loaded":
            return
        if action == "load":
            self.lines.append(f"t={int(t):3d}s load   {name}")
        else:
            self.lines.append(f"t={int(t):3d}s {action} {name} ({reason})")

    async def start(self, t, model, keep_alive):
        self.now = t
        lease = await self.m.acquire(ModelSpec(model), keep_alive)
        self.leases.setdefault(model, []).append(lease)
        return lease

    async def finish(self, t, model):
        self.now = t
        self.leases[model].pop().release()
        await asyncio.sleep(0)

    def loaded(self) -> list[str]:
        return [e.name for e in self.m.runners()]


def run(coro):
    return asyncio.run(coro)


def test_seed_example_2_trace_line_for_line():
    async def main():
        h = Harness()
        await h.start(0, "coder:7b", 300)
        await h.finish(20, "coder:7b")
        await h.start(30, "embed", 0)
        await h.finish(31, "embed")
        await h.start(40, "chat:8b", 600)
        await h.finish(50, "chat:8b")
        await h.start(60, "vision", 300)
        await h.start(70, "draft:1b", 300)
        await h.finish(90, "vision")
        await h.finish(95, "draft:1b")
        await h.start(400, "coder:7b", 300)
        h.lines.append(f"loaded at t=400s: [{', '.join(h.loaded())}]")
        await h.m._closed()
        assert h.runners["embed"].closed and h.runners["vision"].closed and h.runners["draft:1b"].closed
        assert not h.runners["chat:8b"].closed
        return "\n".join(h.lines)

    assert run(main()) == SEED_TRACE


def test_busy_runner_is_never_evicted_and_waiter_proceeds_when_one_is_idle():
    async def main():
        h = Harness(max_loaded=2)
        await h.start(0, "a", 300)
        await h.start(1, "b", 300)
        waiter = asyncio.create_task(h.start(2, "c", 300))
        await asyncio.sleep(0.05)
        assert not waiter.done() and h.m.waiting == 1
        assert h.loaded() == ["a", "b"] and not h.runners["a"].closed
        await h.finish(3, "b")  # b idle: it goes, c loads
        await asyncio.wait_for(waiter, 2)
        assert h.m.waiting == 0
        assert h.loaded() == ["a", "c"]
        assert h.lines == ["t=  0s load   a", "t=  1s load   b", "t=  3s unload b (make room)", "t=  3s load   c"]

    run(main())


def test_failed_load_fails_its_requests_and_leaves_others_serving():
    def loader(spec):
        if spec.name == "broken":
            raise ValueError("not a GGUF file (bad magic b'NOPE')")
        return FakeRunner(spec.name)

    async def main():
        h = Harness(loader=loader)
        await h.start(0, "good", 300)
        results = await asyncio.gather(*(h.m.acquire(ModelSpec("broken")) for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, ServerFaultError) for r in results)
        assert str(results[0]) == "model 'broken' failed to load: not a GGUF file (bad magic b'NOPE')"
        assert h.lines.count("t=  0s load   broken") == 1  # the three requests shared one load
        assert h.loaded() == ["good"]
        lease = await h.m.acquire(ModelSpec("good"))
        assert lease.runner.name == "good"
        lease.release()
        assert h.m.stats.load_failures == 1

    run(main())


def test_concurrent_requests_share_one_load():
    calls = []
    gate = threading.Event()

    def loader(spec):
        calls.append(spec.name)
        gate.wait(5)
        return FakeRunner(spec.name)

    async def main():
        h = Harness(loader=loader)
        tasks = [asyncio.create_task(h.m.acquire(ModelSpec("m"), 60)) for _ in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        leases = await asyncio.gather(*tasks)
        assert calls == ["m"]
        assert len({id(x.runner) for x in leases}) == 1
        assert h.m.get("m").ref_count == 5
        for x in leases:
            x.release()
            x.release()  # idempotent
        assert h.m.get("m").ref_count == 0 and h.m.get("m").expires_at == 60

    run(main())


def test_keep_alive_negative_keeps_forever_and_latest_wins():
    async def main():
        h = Harness()
        await h.start(0, "a", 300)
        await h.finish(1, "a")
        await h.start(2, "a", -1)  # forever now
        await h.finish(3, "a")
        assert h.m.get("a").expires_at is None
        h.now = 10 ** 6
        h.m.expire()
        assert h.loaded() == ["a"]
        await h.start(10 ** 6, "a", 5)
        await h.finish(10 ** 6 + 1, "a")
        h.now = 10 ** 6 + 6
        h.m.expire()
        assert h.loaded() == []

    run(main())


def test_forever_runners_sort_last_for_eviction():
    async def main():
        h = Harness(max_loaded=2)
        await h.start(0, "a", -1)
        await h.finish(1, "a")
        await h.start(2, "z", 600)
        await h.finish(3, "z")
        await h.start(4, "b", 300)
        assert h.lines[-2:] == ["t=  4s unload z (make room)", "t=  4s load   b"]

    run(main())


def test_reload_for_another_context_size_waits_for_idle():
    async def main():
        h = Harness()
        lease = await h.m.acquire(ModelSpec("m", n_ctx=2048))
        other = asyncio.create_task(h.m.acquire(ModelSpec("m", n_ctx=4096)))
        await asyncio.sleep(0.05)
        assert not other.done()
        lease.release()
        new = await asyncio.wait_for(other, 2)
        assert new.runner is not lease.runner and h.m.get("m").spec.n_ctx == 4096
        assert h.lines[-2:] == ["t=  0s unload m (reload)", "t=  0s load   m"]
        new.release()
        # a request that names no context gets the server's default again (review: one client's
        # num_ctx stuck for every later client)
        back = await h.m.acquire(ModelSpec("m"))
        assert h.m.get("m").spec.n_ctx is None and h.lines[-2:] == ["t=  0s unload m (reload)", "t=  0s load   m"]
        back.release()

    run(main())


def test_a_request_for_another_context_size_does_not_join_a_load_in_flight():
    """A request whose num_ctx (or use_mmap) differs from a load in flight waits for it and then
    reloads, as it does when the runner is loaded: joining the load ran it with the other context."""
    gate = threading.Event()
    specs: list[ModelSpec] = []

    def loader(spec):
        specs.append(spec)
        if len(specs) == 1:
            gate.wait(5)
        return FakeRunner(spec.name)

    async def main():
        h = Harness(loader=loader)
        first = asyncio.create_task(h.m.acquire(ModelSpec("m", n_ctx=2048)))
        await asyncio.sleep(0.05)
        other = asyncio.create_task(h.m.acquire(ModelSpec("m", n_ctx=4096)))
        same = asyncio.create_task(h.m.acquire(ModelSpec("m", n_ctx=2048, use_mmap=False)))
        await asyncio.sleep(0.05)
        assert not other.done() and not same.done() and len(specs) == 1
        gate.set()
        lease = await asyncio.wait_for(first, 2)
        assert lease.runner.name == "m" and h.m.get("m").spec.n_ctx == 2048
        await asyncio.sleep(0.05)
        assert not other.done()  # the loaded runner is busy: the reload waits for it to be idle
        lease.release()
        new = await asyncio.wait_for(other, 2)
        assert [s.n_ctx for s in specs] == [2048, 4096] and h.m.get("m").spec.n_ctx == 4096
        new.release()
        last = await asyncio.wait_for(same, 2)
        assert [(s.n_ctx, s.use_mmap) for s in specs][-1] == (2048, False)
        last.release()
        assert h.lines == ["t=  0s load   m", "t=  0s unload m (reload)", "t=  0s load   m",
                           "t=  0s unload m (reload)", "t=  0s load   m"]

    run(main())


def test_memory_evicts_idle_then_refuses_with_the_mib():
    sizes = {"a": 600 * MIB, "b": 600 * MIB, "big": 5000 * MIB}

    async def main():
        h = Harness(estimate=lambda spec: MemoryEstimate(sizes[spec.name], 0),
                    max_memory=1000 * MIB, mem_available=lambda: 10 ** 12)
        await h.start(0, "a", 300)
        await h.finish(1, "a")
        await h.start(2, "b", 300)  # 600 + 600 > 1000: a (idle) goes
        assert h.loaded() == ["b"] and h.lines[-2] == "t=  2s unload a (make room)"
        with pytest.raises(UnavailableError) as ei:
            await h.m.acquire(ModelSpec("big"))
        assert str(ei.value) == "model 'big' requires more system memory (5000 MiB) than is available (1000 MiB)"
        # a busy runner: a model that would fit once it finishes waits, then loads
        waiter = asyncio.create_task(h.start(5, "a", 300))
        await asyncio.sleep(0.05)
        assert not waiter.done() and h.m.waiting == 1
        await h.finish(6, "b")
        await asyncio.wait_for(waiter, 2)
        assert h.loaded() == ["a"]

    run(main())


def test_queue_bound():
    async def main():
        h = Harness(max_loaded=1, max_queue=1)
        await h.start(0, "a", 300)
        t1 = asyncio.create_task(h.m.acquire(ModelSpec("b")))
        await asyncio.sleep(0.02)
        with pytest.raises(UnavailableError, match="maximum pending requests exceeded"):
            await h.m.acquire(ModelSpec("c"))
        t1.cancel()
        await asyncio.gather(t1, return_exceptions=True)
        assert h.m.waiting == 0

    run(main())


def test_pinned_is_never_unloaded():
    async def main():
        h = Harness(max_loaded=1)
        await h.m.preload(ModelSpec("pin", pinned=True), 0)
        assert h.loaded() == ["pin"]
        h.now = 10 ** 7
        h.m.expire()
        assert h.loaded() == ["pin"]
        assert not await h.m.unload("pin")

    run(main())


def test_seed_example_5_memory_figures():
    tiny = estimate_memory(328_377_376, 4, 2, 256 // 8, 4096)
    assert tiny.kv == 4 * MIB
    assert f"{tiny.total_mib:.2f}" == "317.17"
    big = estimate_memory(4_920_000_000, 32, 8, 4096 // 32, 4096)
    assert big.kv == 512 * MIB
    assert f"{big.total_mib:.2f}" == "5204.08"
    assert estimate_memory(100, 1, 1, 1, 1, 2, compute_bytes=7).total == 100 + 4 + 7


@pytest.mark.parametrize("value,seconds", [
    (300, 300.0), (0, 0.0), (1.5, 1.5), (-1, math.inf), ("-1", math.inf), ("10m", 600.0),
    ("1h30m", 5400.0), ("5m0s", 300.0), ("300ms", 0.3), ("0", 0.0), ("300", 300.0), ("-5m", math.inf),
    ("1.5h", 5400.0), (10 ** 12, math.inf),
])
def test_keep_alive_forms(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, None, [], {}, "ten minutes", "10x", "", "m", float("nan"), "NaN", "1e"])
def test_keep_alive_refused(value):
    from kvserve.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="Field 'keep_alive'"):
        parse_keep_alive(value)


def test_format_keep_alive():
    assert format_keep_alive(300) == "5m0s"
    assert format_keep_alive(5400) == "1h30m0s"
    assert format_keep_alive(math.inf) == "forever"


# -- from the attacker's review -----------------------------------------------------------------

def test_two_waiting_models_do_not_both_count_on_the_same_free_memory():
    sizes = {"a": 600 * MIB, "b": 600 * MIB, "c": 600 * MIB}

    async def main():
        h = Harness(estimate=lambda spec: MemoryEstimate(sizes[spec.name], 0), max_memory=1000 * MIB)
        await h.start(0, "a", 300)  # busy
        wb = asyncio.create_task(h.start(1, "b", 300))
        wc = asyncio.create_task(h.start(1, "c", 300))
        await asyncio.sleep(0.05)
        assert h.m.waiting == 2
        await h.finish(2, "a")  # a idle: it goes, b (first in line) loads; c must not load beside it
        await asyncio.wait_for(wb, 2)
        await asyncio.sleep(0.05)
        assert not wc.done() and h.loaded() == ["b"]
        assert sum(e.size for e in h.m.loaded.values()) <= 1000 * MIB
        await h.finish(3, "b")
        await asyncio.wait_for(wc, 2)
        assert h.loaded() == ["c"]

    run(main())


def test_a_waiting_request_is_not_starved_by_traffic_on_the_busy_model():
    async def main():
        h = Harness(max_loaded=1)
        await h.start(0, "a", 300)
        wb = asyncio.create_task(h.start(1, "b", 300))
        await asyncio.sleep(0.02)
        late_a = asyncio.create_task(h.start(2, "a", 300))  # a is loaded, but b waits ahead of it
        await asyncio.sleep(0.02)
        assert not late_a.done() and h.m.waiting == 2
        await h.finish(3, "a")
        await asyncio.wait_for(wb, 2)  # b was first in line
        assert h.loaded() == ["b"] and not late_a.done()
        await h.finish(4, "b")
        await asyncio.wait_for(late_a, 2)
        assert h.loaded() == ["a"] and h.m.waiting == 0

    run(main())


class Big:
    pass


def test_a_failed_load_leaves_nothing_behind_and_is_remembered_briefly():
    import gc
    import weakref

    refs, calls = [], []

    def loader(spec):
        calls.append(spec.name)
        half_built = Big()
        refs.append(weakref.ref(half_built))
        raise ValueError(f"{spec.path}: tensor 'x' is corrupt")

    async def main():
        h = Harness(loader=loader)
        with pytest.raises(ServerFaultError) as e1:
            await h.m.acquire(ModelSpec("bad", "/srv/blobs/sha256-1"))
        assert str(e1.value) == "model 'bad' failed to load: bad: tensor 'x' is corrupt"  # no server path
        assert e1.value.detail == "/srv/blobs/sha256-1: tensor 'x' is corrupt"
        gc.collect()
        assert refs[0]() is None  # the traceback's frames did not keep the half-built model
        h.now = 3
        with pytest.raises(ServerFaultError, match="failed to load"):
            await h.m.acquire(ModelSpec("bad", "/srv/blobs/sha256-1"))
        assert calls == ["bad"]  # remembered: no second load within 5 s
        h.now = 6
        with pytest.raises(ServerFaultError):
            await h.m.acquire(ModelSpec("bad", "/srv/blobs/sha256-1"))
        assert calls == ["bad", "bad"]
        assert h.m.stats.load_failures == 2  # a remembered failure is not another load
        # another context size or another file under the name is another load, not the remembered failure
        with pytest.raises(ServerFaultError):
            await h.m.acquire(ModelSpec("bad", "/srv/blobs/sha256-1", n_ctx=512))
        with pytest.raises(ServerFaultError):
            await h.m.acquire(ModelSpec("bad", "/srv/blobs/sha256-2"))
        assert calls == ["bad"] * 4 and h.m.stats.load_failures == 4

    run(main())


def test_a_header_that_cannot_be_read_is_a_failed_load():
    def estimate(spec):
        raise ValueError("not a GGUF file (bad magic b'NOPE')")

    async def main():
        h = Harness(estimate=estimate, mem_available=lambda: 10 ** 12)
        with pytest.raises(ServerFaultError, match="model 'x' failed to load: not a GGUF file"):
            await h.m.acquire(ModelSpec("x"))
        assert h.lines == ["t=  0s fail x (not a GGUF file (bad magic b'NOPE'))"]
        assert h.m.stats.load_failures == 1 and h.m.loaded == {}

    run(main())


def test_keep_current_leaves_keep_alive_alone():
    from kvserve.serving.manager import KEEP_CURRENT

    async def main():
        h = Harness(default_keep_alive=4)
        await h.start(0, "a", -1)
        await h.finish(1, "a")
        lease = await h.m.acquire(ModelSpec("a"), KEEP_CURRENT)
        lease.release()
        assert h.m.get("a").keep_alive == -1 and h.m.get("a").expires_at is None
        lease = await h.m.acquire(ModelSpec("b"), KEEP_CURRENT)  # not loaded: the default
        lease.release()
        assert h.m.get("b").keep_alive == 4

    run(main())


def test_keep_alive_edge_values():
    from kvserve.errors import InvalidInputError

    assert parse_keep_alive(10 ** 400) == math.inf and parse_keep_alive(-(10 ** 400)) == math.inf
    for v in (float("inf"), float("-inf")):
        with pytest.raises(InvalidInputError, match="finite"):
            parse_keep_alive(v)


def test_hold_loaded_neither_loads_nor_counts_as_use():
    h = Harness()

    async def main():
        with pytest.raises(UnavailableError, match="model 'a' is not loaded"):
            h.m.hold_loaded("a")
        await h.start(0, "a", 100)
        await h.finish(10, "a")
        assert h.m.get("a").expires_at == 110
        h.now = 50
        hold = h.m.hold_loaded("a")  # idle: held without counting as use
        assert (h.m.get("a").ref_count, h.m.get("a").expires_at) == (1, None)
        h.m.expire(200)  # not evicted while held
        hold.release()
        hold.release()  # idempotent
        assert (h.m.get("a").ref_count, h.m.get("a").expires_at) == (0, 110)
        await h.start(60, "a", 100)
        hold = h.m.hold_loaded("a")  # busy: the request's end starts the timer, whoever ends last
        await h.finish(70, "a")
        assert (h.m.get("a").ref_count, h.m.get("a").expires_at) == (1, None)
        h.now = 80
        hold.release()
        assert (h.m.get("a").ref_count, h.m.get("a").expires_at) == (0, 180)
        assert h.lines == ["t=  0s load   a"]

    asyncio.run(main())
