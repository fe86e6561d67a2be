"""The serving layer's chat events (kvserve.serving.choices.chat_events), from fake engine
outputs: the pieces of each choice (or its whole answer), its finish reason, the usage with the last event."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

import kvserve.serving.choices as choices
from kvserve.engine.request import PromptProgress, RequestOutput
from kvserve.errors import ServerFaultError
from kvserve.serving.chat_output import Answer, OutputMode, ReasoningPiece, TextPiece, ToolCallPiece


def _out(text: str, *, finished: bool = False, stop: str = "eos", prompt: int = 7, cached: int = 3, n_out: int = 0,
         error: str | None = None, **kw) -> RequestOutput:
    return RequestOutput("r", [1] if text else [], text, finished=finished, stop_type=stop if finished else "none",
                         num_prompt_tokens=prompt, num_cached_tokens=cached, num_output_tokens=n_out, error=error,
                         **kw)


def _events(monkeypatch, outs: list[tuple[int, RequestOutput]], mode: OutputMode, n: int = 1, **kw) -> list:
    async def fake(runner, plan, view=None, *, whole=False):
        for item in outs:
            yield item

    monkeypatch.setattr(choices, "run_choices", fake)
    plan = SimpleNamespace(requests=[None] * len({i for i, _ in outs}), n=n, mode=mode)

    async def collect():
        return [e async for e in choices.chat_events(None, plan, **kw)]

    return asyncio.run(collect())


def test_plain_choices_give_text_pieces_and_usage_once_per_prompt(monkeypatch):
    outs = [(0, _out("Hel")), (1, _out("Yo")), (0, _out("lo", finished=True, n_out=2)),
            (1, _out("", finished=True, stop="limit", n_out=4))]
    evs = _events(monkeypatch, outs, OutputMode(), n=2)
    assert [(e.index, e.pieces, e.finish_reason, e.called_tools) for e in evs] == [
        (0, [TextPiece("Hel")], None, False), (1, [TextPiece("Yo")], None, False),
        (0, [TextPiece("lo")], "stop", False), (1, [], "length", False)]
    assert [e.usage for e in evs[:3]] == [None] * 3
    assert [e.answer for e in evs] == [None] * 4
    # two choices of one prompt: its tokens count once
    assert evs[3].usage == choices.ChatUsage(prompt_tokens=7, completion_tokens=6, cached_tokens=3,
                                             reasoning_tokens=None)


def test_reasoning_is_split_and_counted(monkeypatch):
    outs = [(0, _out("<think>")), (0, _out("a b")), (0, _out("</think>")), (0, _out("Hi", finished=True, n_out=4))]
    evs = _events(monkeypatch, outs, OutputMode(reasoning_style="deepseek"))
    pieces = [p for e in evs for p in e.pieces]
    assert pieces == [ReasoningPiece("a b"), TextPiece("Hi")]
    # one per engine output of the thinking block, its tags included (ChoiceOutput's count, as the OpenAI face reports)
    assert evs[-1].finish_reason == "stop" and evs[-1].usage.reasoning_tokens == 3


def test_whole_answers_come_with_the_last_event(monkeypatch):
    outs = [(0, _out("<think>")), (0, _out("a b")), (0, _out("</think>")), (0, _out("Hi", finished=True, n_out=4))]
    evs = _events(monkeypatch, outs, OutputMode(reasoning_style="deepseek"), whole=True)
    assert [e.pieces for e in evs] == [[]] * 4
    assert [e.answer for e in evs] == [None] * 3 + [Answer("Hi", "a b", [])]
    assert evs[-1].usage.reasoning_tokens == 3  # counted as the stream counts


def test_whole_answers_from_merged_outputs_count_as_their_parts(monkeypatch):
    """A non-streamed request's outputs after the first come merged (AsyncEngine ``whole``):
    thinking tokens are still counted per engine output, the answer is the same."""
    first, *rest = [_out("<think>"), _out("a b"), _out("</think>"), _out("Hi", finished=True, n_out=4)]
    merged = dataclasses.replace(rest[0])
    for o in rest[1:]:
        merged.merge(o)
    assert merged.part_texts() == ["a b", "</think>", "Hi"] and merged.new_token_ids == [1, 1, 1]
    evs = _events(monkeypatch, [(0, first), (0, merged)], OutputMode(reasoning_style="deepseek"), whole=True)
    assert [e.answer for e in evs] == [None, Answer("Hi", "a b", [])]
    assert evs[-1].usage.reasoning_tokens == 3 and evs[-1].usage.completion_tokens == 4


def test_tool_calls_are_pieces_and_the_finish_says_so(monkeypatch):
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    outs = [(0, _out("Go")), (0, _out(text, finished=True, n_out=9))]
    evs = _events(monkeypatch, outs, OutputMode(tool_parser="hermes"))
    calls = [p for e in evs for p in e.pieces if isinstance(p, ToolCallPiece)]
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "f", '{"a": 1}')]
    assert [p for e in evs for p in e.pieces if isinstance(p, TextPiece)] == [TextPiece("Go")]
    assert (evs[-1].finish_reason, evs[-1].called_tools) == ("stop", True)
    whole = _events(monkeypatch, outs, OutputMode(tool_parser="hermes"), whole=True)[-1]
    assert (whole.answer.text, [(c.index, c.name, c.arguments) for c in whole.answer.tool_calls]) == \
        ("Go", [(0, "f", '{"a": 1}')])
    assert whole.called_tools


def test_progress_outputs_are_skipped_unless_asked_and_an_engine_error_is_a_server_fault(monkeypatch):
    prog = _out("", prompt_progress=PromptProgress(total=7, cache=0, processed=4, time_ms=1))
    evs = _events(monkeypatch, [(0, prog), (0, _out("x", finished=True, n_out=1))], OutputMode())
    assert [e.pieces for e in evs] == [[TextPiece("x")]]
    evs = _events(monkeypatch, [(0, prog), (0, _out("x", finished=True, n_out=1))], OutputMode(), progress=True)
    assert [(e.output is prog, e.pieces, e.finish_reason) for e in evs] == [(True, [], None),
                                                                          (False, [TextPiece("x")], "stop")]
    with pytest.raises(ServerFaultError, match="^engine died$"):
        _events(monkeypatch, [(0, _out("", finished=True, error="engine died"))], OutputMode())


def _text_of(evs) -> str:
    return "".join(p.text for e in evs for p in e.pieces if isinstance(p, TextPiece))


def _prefix_cases():
    from kvserve.chat.tool_parsers import TOOL_PARSERS

    for name, cls in TOOL_PARSERS.items():
        if name == "openai":  # harmony: <|start|> / <|channel|> are message boundaries, not a call's start
            continue
        for m in cls.start_markers or cls.marker_texts:
            for cut in sorted({max(1, len(m) // 2), len(m)}):
                yield name, m[:cut]


@pytest.mark.parametrize(("parser", "held"), list(_prefix_cases()))
def test_text_held_back_for_a_call_that_never_came_is_content_at_the_end(monkeypatch, parser, held):
    """The parser holds back what may open a call; when the answer stops (max_tokens, EOS) before
    it became one, that text is content, streamed and whole alike (llama-server, vLLM)."""
    outs = [(0, _out("Hello ")), (0, _out(held, finished=True, stop="limit", n_out=4))]
    mode = OutputMode(tool_parser=parser)
    evs = _events(monkeypatch, outs, mode)
    assert (_text_of(evs), evs[-1].finish_reason, evs[-1].called_tools) == ("Hello " + held, "length", False)
    whole = _events(monkeypatch, outs, mode, whole=True)[-1]
    assert (whole.answer.text, whole.answer.tool_calls) == ("Hello " + held, [])


@pytest.mark.parametrize(("prefill", "outs", "content"), [
    # a continued "<tool_call>\n" cut off by max_tokens: only the new text, never the prefill's marker
    ("<tool_call>\n", ['{"name": "f", ', '"argu'], '{"name": "f", "argu'),
    # the prefill's trailing space was held back: it is not new text either
    ("Sure ", ["here <tool", "_call>\n{"], "here <tool_call>\n{"),
    ("Sure ", ["here"], "here"),
])
def test_a_continued_message_streams_only_new_text(monkeypatch, prefill, outs, content):
    """A continued assistant message (prefill) is fed to the tool parser but is not new text:
    the stream gives what the whole answer gives (it used to send the held-back prefill too)."""
    engine = [(0, _out(t)) for t in outs[:-1]] + [(0, _out(outs[-1], finished=True, stop="limit", n_out=5))]
    mode = OutputMode(tool_parser="hermes", prefill=prefill)
    assert _text_of(_events(monkeypatch, engine, mode)) == content
    assert _events(monkeypatch, engine, mode, whole=True)[-1].answer.text == content


def test_a_continued_call_streams_the_call_and_only_the_new_text(monkeypatch):
    outs = [(0, _out('{"name": "f", "arguments": {}}\n</tool_call>')), (0, _out(" ok", finished=True, n_out=9))]
    mode = OutputMode(tool_parser="hermes", prefill="<tool_call>\n")
    evs = _events(monkeypatch, outs, mode)
    calls = [(p.index, p.name, p.arguments) for e in evs for p in e.pieces if isinstance(p, ToolCallPiece)]
    assert (calls, evs[-1].called_tools) == ([(0, "f", "{}")], True)
    whole = _events(monkeypatch, outs, mode, whole=True)[-1].answer
    assert [(c.index, c.name, c.arguments) for c in whole.tool_calls] == [(0, "f", "{}")]
    assert _text_of(evs) == whole.text
