"""AsyncEngine's delivery: a non-streamed request's outputs merged on the engine thread (the loop
is not woken per token), outputs that pile up while the loop is busy taken in one wake but
yielded one by one, and the vLLM metrics counting a merged output exactly as its parts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvserve.engine.async_engine as ae
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, RequestOutput, SamplingParams, Timings
from kvserve.models.build import load_files
from kvserve.serving.metrics import VllmMetrics

N = 12


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(rid: str) -> Request:
    return Request(rid, _prompt(5), SamplingParams(n_predict=N, temperature=0.0, ignore_eos=True, n_probs=2),
                   cache_salt=rid)  # no prefix-cache hit from the previous test's request


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    eng = ae.AsyncEngine(EngineCore(load_files(tiny_gguf), EngineConfig(n_ctx=256, dtype="float32")))
    yield eng
    eng.shutdown()


def _collect(eng, req, *, whole=False, pause_s=0.0):
    async def main():
        outs = []
        async for out in eng.generate(req, whole=whole):
            outs.append(out)
            if pause_s and len(outs) == 1:
                time.sleep(pause_s)  # blocks the loop: the engine's next outputs pile up meanwhile
        return outs
    return asyncio.run(main())


def test_whole_merges_every_output_after_the_first_into_one(engine, monkeypatch):
    monkeypatch.setattr(ae, "WHOLE_FLUSH_S", 3600.0)  # no interval flush: the finish alone delivers
    streamed = _collect(engine, _request("s"))
    whole = _collect(engine, _request("w"), whole=True)
    assert [len(o.new_token_ids) for o in streamed] == [1] * N
    assert len(whole) == 2 and whole[0].parts is None and whole[1].finished
    merged = whole[1]
    assert [n for _, n, _ in merged.parts] == [1] * (N - 1)
    assert [c for _, _, c in merged.parts] == [len(o.text) for o in streamed[1:]]
    assert merged.part_texts() == [o.text for o in streamed[1:]]
    times = [t for t, _, _ in merged.parts]
    assert times == sorted(times) and times[0] >= whole[0].made_time > 0 and merged.made_time == times[-1]
    # the concatenation is what the streamed outputs held, token for token
    assert whole[0].new_token_ids + merged.new_token_ids == [t for o in streamed for t in o.new_token_ids]
    assert whole[0].text + merged.text == "".join(o.text for o in streamed)
    lps = [(lp.id, lp.logprob) for o in whole for lp in o.logprobs]
    assert lps == [(lp.id, lp.logprob) for o in streamed for lp in o.logprobs] and len(lps) == N
    last = streamed[-1]
    for f in ("finished", "stop_type", "stopping_word", "num_prompt_tokens", "num_cached_tokens",
              "num_output_tokens", "truncated", "error"):
        assert getattr(merged, f) == getattr(last, f), f
    assert (merged.timings.prompt_n, merged.timings.predicted_n) == (last.timings.prompt_n, N)


def test_whole_flushes_at_the_interval(engine, monkeypatch):
    monkeypatch.setattr(ae, "WHOLE_FLUSH_S", 0.0)  # every output flushes: nothing is held back
    whole = _collect(engine, _request("w0"), whole=True)
    assert [len(o.new_token_ids) for o in whole] == [1] * N
    assert all(len(o.parts or [None]) == 1 for o in whole)


def test_streamed_outputs_that_pile_up_still_come_one_by_one(engine):
    outs = _collect(engine, _request("p"), pause_s=0.3)
    assert [len(o.new_token_ids) for o in outs] == [1] * N and outs[-1].finished
    assert [o.num_output_tokens for o in outs] == list(range(1, N + 1))
    assert all(o.parts is None and o.made_time > 0 for o in outs)


def _samples(m: VllmMetrics) -> dict:
    from prometheus_client import generate_latest
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
            for s in fam.samples if not s.name.endswith("_created")}


def _stub():
    engine = types.SimpleNamespace(n_ctx_slot=256, core=None, stats=None)
    return types.SimpleNamespace(engine=engine, model_alias="stub", slots=None,
                                 args=types.SimpleNamespace(disable_log_stats=True))


def test_metrics_count_a_merged_output_as_its_parts():
    t0 = time.monotonic() - 10
    # arrival t0; tokens made at t0 + 0.5 (first), 0.75, 1.5, 1.625 (the last one finishes)
    outs = [RequestOutput("r", [5], "a", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=1,
                          arrival_time=t0, timings=Timings(prompt_ms=1.0), made_time=t0 + 0.5),
            RequestOutput("r", [6], "bc", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=2,
                          arrival_time=t0, made_time=t0 + 0.75),
            RequestOutput("r", [7], "", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=3,
                          arrival_time=t0, made_time=t0 + 1.5),
            RequestOutput("r", [8], "d", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=4,
                          arrival_time=t0, made_time=t0 + 1.625, finished=True, stop_type="eos")]
    one_by_one, merged = VllmMetrics(_stub()), VllmMetrics(_stub())
    for o in outs:
        one_by_one.on_output(o)
    m = dataclasses.replace(outs[1])
    m.merge(outs[2])
    m.merge(outs[3])
    assert (m.new_token_ids, m.text, m.part_texts(), m.finished) == ([6, 7, 8], "bcd", ["bc", "", "d"], True)
    merged.on_output(outs[0])
    merged.on_output(m)
    a, b = _samples(one_by_one), _samples(merged)
    assert a == b
    itl = "vllm:inter_token_latency_seconds"
    assert a[(itl + "_count", (("engine", "0"), ("model_name", "stub")))] == 3
    assert a[(itl + "_sum", (("engine", "0"), ("model_name", "stub")))] == pytest.approx(1.125)
    e2e = "vllm:e2e_request_latency_seconds_sum"
    assert a[(e2e, (("engine", "0"), ("model_name", "stub")))] == pytest.approx(1.625)
    assert a[("vllm:time_to_first_token_seconds_sum", (("engine", "0"), ("model_name", "stub")))] == \
        pytest.approx(0.5)
    assert a[("vllm:generation_tokens_total", (("engine", "0"), ("model_name", "stub")))] == 4
