"""The serving layer's chat events (kvserve.serving.choices.chat_events), from fake engine
outputs: the pieces of each choice, its finish reason, the usage with the last event."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import kvserve.serving.choices as choices
from kvserve.engine.request import PromptProgress, RequestOutput
from kvserve.errors import ServerFaultError
from kvserve.serving.chat_output import OutputMode


def _out(text: str, *, finished: bool = False, stop: str = "eos", prompt: int = 7, cached: int = 3, n_out: int = 0,
         error: str | None = None, **kw) -> RequestOutput:
    return RequestOutput("r", [1] if text else [], text, finished=finished, stop_type=stop if finished else "none",
                         num_prompt_tokens=prompt, num_cached_tokens=cached, num_output_tokens=n_out, error=error,
                         **kw)


def _events(monkeypatch, outs: list[tuple[int, RequestOutput]], mode: OutputMode, n: int = 1) -> list:
    async def fake(runner, plan, view=None):
        for item in outs:
            yield item

    monkeypatch.setattr(choices, "run_choices", fake)
    plan = SimpleNamespace(requests=[None] * len({i for i, _ in outs}), n=n, mode=mode)

    async def collect():
        return [e async for e in choices.chat_events(None, plan)]

    return asyncio.run(collect())


def test_plain_choices_give_content_pieces_and_usage_once_per_prompt(monkeypatch):
    outs = [(0, _out("Hel")), (1, _out("Yo")), (0, _out("lo", finished=True, n_out=2)),
            (1, _out("", finished=True, stop="limit", n_out=4))]
    evs = _events(monkeypatch, outs, OutputMode(), n=2)
    assert [(e.index, e.deltas, e.finish_reason) for e in evs] == [
        (0, [{"content": "Hel"}], None), (1, [{"content": "Yo"}], None), (0, [{"content": "lo"}], "stop"),
        (1, [], "length")]
    assert [e.usage for e in evs[:3]] == [None] * 3
    # two choices of one prompt: its tokens count once
    assert evs[3].usage == choices.ChatUsage(prompt_tokens=7, completion_tokens=6, cached_tokens=3,
                                             reasoning_tokens=None)


def test_reasoning_is_split_and_counted(monkeypatch):
    outs = [(0, _out("<think>")), (0, _out("a b")), (0, _out("</think>")), (0, _out("Hi", finished=True, n_out=4))]
    evs = _events(monkeypatch, outs, OutputMode(reasoning_style="deepseek"))
    pieces = [d for e in evs for d in e.deltas]
    assert "".join(d.get("reasoning_content", "") for d in pieces) == "a b"
    assert "".join(d.get("content", "") for d in pieces) == "Hi"
    # one per engine output of the thinking block, its tags included (ChoiceOutput's count, as the OpenAI face reports)
    assert evs[-1].finish_reason == "stop" and evs[-1].usage.reasoning_tokens == 3


def test_progress_outputs_are_skipped_and_an_engine_error_is_a_server_fault(monkeypatch):
    prog = _out("", prompt_progress=PromptProgress(total=7, cache=0, processed=4, time_ms=1))
    evs = _events(monkeypatch, [(0, prog), (0, _out("x", finished=True, n_out=1))], OutputMode())
    assert [e.deltas for e in evs] == [[{"content": "x"}]]
    with pytest.raises(ServerFaultError, match="^engine died$"):
        _events(monkeypatch, [(0, _out("", finished=True, error="engine died"))], OutputMode())
