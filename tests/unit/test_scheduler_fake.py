"""Scheduler and EngineCore with the fake runner (kvserve.engine.fake): no model, milliseconds a test."""

import time

import pytest

from kvserve.engine.fake import FakeRunner, expected_tokens, fake_engine_core
from kvserve.engine.request import Request, RequestStatus, SamplingParams

V = 64  # the fake vocabulary


def req(rid: str, prompt: list[int], n: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(n_predict=n, **kw))


def run(core, reqs: list[Request], max_steps: int = 1000) -> dict[str, list]:
    """Add ``reqs``, step until all finished; {request_id: outputs}."""
    outs = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    for _ in range(max_steps):
        for o in core.step():
            outs[o.request_id].append(o)
        if all(o and o[-1].finished for o in outs.values()):
            return outs
    raise AssertionError("requests did not finish")


def toks(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(autouse=True)
def fast():
    t0 = time.perf_counter()
    yield
    assert time.perf_counter() - t0 < 2.0  # the point of the fake: no model, no forward


def test_several_requests_share_steps_with_chunked_prefill():
    core = fake_engine_core(n_ctx=256, n_parallel=3, max_num_batched_tokens=16)
    assert isinstance(core.runner, FakeRunner) and core.model is None
    prompts = {"a": list(range(3, 13)), "b": list(range(20, 50)), "c": [5, 6, 7]}
    reqs = [req(rid, p, 5) for rid, p in prompts.items()]
    outs = run(core, reqs)
    for rid, p in prompts.items():
        assert toks(outs[rid]) == expected_tokens(p, 5, V)
        assert outs[rid][-1].stop_type == "limit"
        assert "".join(o.text for o in outs[rid]) == "".join(f"<{t}>" for t in expected_tokens(p, 5, V))
    steps = core.runner.steps
    assert steps[0] == [("a", 0, 10), ("b", 0, 6)]  # budget 16: a whole, b's first chunk; c waits
    assert steps[1] == [("a", 10, 1), ("b", 6, 15)]  # a decodes while b's prompt goes on (chunked)
    assert all(sum(n for _, _, n in st) <= 16 for st in steps)
    assert all(len(st) <= 3 for st in steps)
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1 and not core.has_work()


def test_more_requests_than_slots_wait_their_turn():
    core = fake_engine_core(n_ctx=256, n_parallel=2)
    reqs = [req(f"r{i}", [10 + i, 11 + i], 3) for i in range(5)]
    outs = run(core, reqs)
    assert all(toks(outs[r.request_id]) == expected_tokens(r.prompt_token_ids, 3, V) for r in reqs)
    assert max(len(st) for st in core.runner.steps) == 2  # never more sequences than slots
    firsts = [next(i for i, st in enumerate(core.runner.steps) if any(c[0] == r.request_id for c in st))
              for r in reqs]
    assert firsts == sorted(firsts) and firsts[2] > firsts[1]  # FIFO: r2 starts only when one ended


def test_out_of_blocks_preempts_the_newest_and_recomputes_it():
    # 2 sequences of 60 tokens need 8 blocks; the pool has ceil(64 / 16) + 2 = 6
    core = fake_engine_core(n_ctx=64, n_parallel=2, kv_unified=True)
    assert core.kv.num_blocks == 1 + 6
    a, b = req("a", list(range(3, 23)), 40), req("b", list(range(30, 50)), 40)
    outs = run(core, [a, b])
    assert core.stats.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert toks(outs["a"]) == expected_tokens(a.prompt_token_ids, 40, V)
    assert toks(outs["b"]) == expected_tokens(b.prompt_token_ids, 40, V)  # recomputed, same tokens
    starts = [n for st in core.runner.steps for rid, s, n in st if rid == "b" and s == 0]
    assert len(starts) == 1 + b.num_preemptions and starts[1] > 20  # recomputed: prompt + what it had made


def test_abort_frees_blocks_at_once_and_others_go_on():
    core = fake_engine_core(n_ctx=256, n_parallel=2)
    a, b = req("a", [4, 5, 6], 50), req("b", [7, 8], 6)
    core.add_request(a)
    core.add_request(b)
    core.step()
    core.step()
    free_before = core.kv.num_free_blocks
    core.abort_request("a")
    outs = core.step()
    final = [o for o in outs if o.request_id == "a"]
    assert final and final[0].finished and final[0].stop_type == "abort"
    assert a.status == RequestStatus.FINISHED_ABORTED and core.kv.num_free_blocks > free_before
    assert all(c[0] != "a" for c in core.runner.steps[-1])  # the same step ran without it
    while core.has_work():
        core.step()
    assert b.output_token_ids == expected_tokens([7, 8], 6, V)
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1


def test_stop_string_and_prefix_cache_reuse():
    core = fake_engine_core(n_ctx=256, n_parallel=1)
    p = list(range(3, 40))
    want = expected_tokens(p, 4, V)
    first = req("s", p, 20, stop=[f"<{want[2]}>"])
    first.priority_slot = 0  # its blocks stay parked under slot 0 when it ends
    outs = run(core, [first])["s"]
    assert outs[-1].stop_type == "word" and toks(outs) == want[:3]
    assert core.slot_tokens(0) == p + want[:2]  # the stop token was sampled, never computed
    again = req("t", p, 2)
    again.priority_slot = 0
    out = run(core, [again])["t"]
    assert out[-1].num_cached_tokens == len(p) - 1 and toks(out) == want[:2]  # all but the last prompt token
    assert core.runner.steps[-2] == [("t", len(p) - 1, 1)]
