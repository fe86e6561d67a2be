"""SlotManager over the engine's slot_cache (one owner of a slot's cached tokens), on the fake runner."""

import asyncio

from kvserve.engine.fake import expected_tokens, fake_engine_core
from kvserve.engine.request import Request, SamplingParams
from kvserve.serving.slots import SlotManager

V = 64
A = list(range(3, 43))  # 40 tokens: 3 blocks parked after 2 generated tokens
B = [60, 61, 62, 63, 60, 61, 62, 63]  # shares no prefix with A


def _core():
    # a pool of ceil(64 / 16) + 2 = 6 blocks and no host tier: B's 57 tokens (4 blocks)
    # need the 3 blocks A's slot parked
    return fake_engine_core(n_ctx=64, n_parallel=2, kv_unified=True)


async def _serve(mgr: SlotManager, core, prompt: list[int], n: int, rid: str):
    """What the serving layer does for one request (serving/state.py): acquire a slot, begin,
    feed it the engine's outputs, release. The fake engine is stepped here."""
    slot = await mgr.acquire(prompt)
    req = Request(rid, prompt, SamplingParams(n_predict=n), priority_slot=slot.id)
    slot.begin(prompt, mgr.next_task_id(), n, {})
    core.add_request(req)
    return slot, req


def _step_until(core, mgr, live: dict, done: str):
    """Step the engine, applying outputs to their slots, until request ``done`` finished."""
    while True:
        for out in core.step():
            slot = live[out.request_id]
            slot.update(out)
            if out.finished:
                mgr.release(slot)
                if out.request_id == done:
                    return


def test_a_parked_slot_whose_blocks_the_pool_evicted_claims_nothing():
    core = _core()
    mgr = SlotManager(2, core.n_ctx_slot, 0.10, engine=core)

    async def main():
        sb, _ = await _serve(mgr, core, B, 49, "b")  # long: grows while A runs and ends
        live = {"b": sb}
        core.step()  # B's prompt
        sa, _ = await _serve(mgr, core, A, 2, "a")
        live["a"] = sa
        assert (sa.id, sb.id) == (1, 0)
        _step_until(core, mgr, live, "a")
        held = list(A) + expected_tokens(A, 2, V)[:1]  # the last sampled token was never computed
        assert core.slot_cache[1] == tuple(held)
        view = mgr.views()[1]
        assert view["n_prompt_tokens"] == len(held) and not view["is_processing"]
        assert mgr.pick(A + [7, 8]) is sa  # the prompt shares 40 tokens with what slot 1 holds
        _step_until(core, mgr, live, "b")  # B grew to 4 blocks: the pool evicted slot 1's parked blocks
        assert core.kv.parked_tokens("slot:1") == []
        assert 1 not in core.slot_cache
        assert mgr.views()[1]["n_prompt_tokens"] == 0  # was 42: the tokens of a sequence no longer cached
        assert sa.tokens == A + expected_tokens(A, 2, V)  # the last request's record, not the cache
        # similarity no longer sends an A-like prompt to slot 1; the LRU slot (0) takes it
        assert mgr.pick(A + [7, 8]) is sb

    asyncio.run(main())


def test_without_an_engine_a_slot_remembers_its_last_sequence():
    """SlotManager(n_slots, n_ctx_slot, similarity) alone keeps today's behaviour."""
    mgr = SlotManager(2, 64, 0.10)

    async def main():
        s = await mgr.acquire(A)
        s.begin(A, mgr.next_task_id(), 2, {})
        assert mgr.views()[s.id]["n_prompt_tokens"] == 40
        mgr.release(s)
        assert mgr.views()[s.id]["n_prompt_tokens"] == 40 and mgr.pick(A + [1]) is s

    asyncio.run(main())


def test_erase_and_restore_publish_through_slot_cache():
    core = _core()
    mgr = SlotManager(2, core.n_ctx_slot, 0.10, engine=core)
    req = Request("p", A[:20], SamplingParams(n_predict=0), priority_slot=0)
    core.add_request(req)
    while core.has_work():
        core.step()
    assert mgr.views()[0]["n_prompt_tokens"] == 20
    assert core.erase_slot(0) == {"n_erased": 20}
    # erased, and it never ran a task through the manager: llama-server's four keys of an unused slot
    assert mgr.views()[0] == {"id": 0, "n_ctx": core.n_ctx_slot, "speculative": False, "is_processing": False}
    assert core.slot_cache == {}
