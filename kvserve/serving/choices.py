"""Running a plan's choices: every engine request of a :class:`~kvserve.serving.chat_plan.Plan`
at once (:func:`run_choices`), and for chat plans the answer as the serving layer's events
(:func:`chat_events`: the text split into text, reasoning and tool-call pieces by
:class:`~kvserve.serving.chat_output.ChoiceOutput`, or each choice's whole answer). Faces turn
these into their dialect's JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.request import Request, RequestOutput
from kvserve.errors import ServerFaultError
from kvserve.serving.chat_output import Answer, ChoiceOutput, Piece, TextPiece
from kvserve.serving.chat_runner import fair_share, generate

if TYPE_CHECKING:
    from kvserve.serving.chat_plan import Plan
    from kvserve.serving.chat_runner import Runner

__all__ = ["ChatEvent", "ChatUsage", "chat_events", "run_choices"]

#: what ``/slots`` shows as a running request's ``params`` (a face renders it)
ParamsView = Callable[[Request], dict]


async def run_choices(runner: Runner, plan: Plan, view: ParamsView | None = None, *, whole: bool = False) \
        -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every choice of ``plan`` concurrently (within the runner's fair share of slots) and
    yield ``(index, output)`` as outputs come; ``view(request)`` is the request's ``/slots`` view.
    ``whole``: a non-streamed answer; outputs after a choice's first may come merged
    (:func:`~kvserve.serving.chat_runner.generate`).

    A choice's exception is raised here. Closing the iterator (client disconnect) cancels
    every choice, which aborts them in the engine and frees their slots.
    """
    q: asyncio.Queue = asyncio.Queue()
    gate = fair_share(runner)

    async def produce(i: int, req: Request) -> None:
        try:
            async with gate:
                async for out in generate(runner, req, view(req) if view is not None else None, whole=whole):
                    q.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(produce(i, r)) for i, r in enumerate(plan.requests)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChatUsage:
    """Token counts of a finished chat plan (prompt counts once per prompt, not per choice)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # None: the plan does not split reasoning out
    estimated: bool = False  # a remote model's upstream gave no usage: counted from the text (kvserve.remote)


@dataclass(slots=True)
class ChatEvent:
    """One step of one choice's answer.

    Attributes:
        index: the choice.
        output: the engine's output behind this event (its tokens, logprobs, timings; under
            ``progress=True`` a prompt-progress output, with no pieces).
        pieces: the new parts of the answer (streaming; empty under ``whole=True``).
        finish_reason: when the choice finished: the engine's (``stop``, ``length``); None before.
        called_tools: when the choice finished: whether it called tools (the dialects name
            that finish their own way).
        answer: under ``whole=True``, on the choice's last event: the whole answer.
        usage: with the last event of the plan, the counts of every choice.
    """

    index: int
    output: RequestOutput
    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str | None = None
    called_tools: bool = False
    answer: Answer | None = None
    usage: ChatUsage | None = None


def _usage(plan: Plan, finals: list[RequestOutput], posts: list[ChoiceOutput | None]) -> ChatUsage:
    firsts = finals[::plan.n]  # one per prompt
    reasoning = sum(p.reasoning_tokens for p in posts if p is not None) if plan.mode.splits_reasoning else None
    return ChatUsage(sum(o.num_prompt_tokens for o in firsts), sum(o.num_output_tokens for o in finals),
                     sum(o.num_cached_tokens for o in firsts), reasoning)


async def chat_events(runner: Runner, plan: Plan, view: ParamsView | None = None, *, whole: bool = False,
                      progress: bool = False) -> AsyncIterator[ChatEvent]:
    """A chat plan's answers as :class:`ChatEvent` s, one per engine output.

    ``whole``: no pieces; each choice's last event carries its :class:`Answer` (the whole text
    parsed at once, as a non-streamed answer is). ``progress``: prompt-progress outputs (requests
    with ``return_progress``) come as events without pieces; otherwise they are skipped.

    Raises:
        ServerFaultError: an engine output carries an error (its text).
        whatever :func:`run_choices` raises.
    """
    if getattr(plan, "remote", None) is not None:  # a remote model: its upstream answers (kvserve.remote)
        async for ev in runner.chat_events(plan, whole=whole, progress=progress):
            yield ev
        return
    n = len(plan.requests)
    posts = [ChoiceOutput(plan.mode) if plan.mode.active else None for _ in range(n)]
    texts: list[list[str]] = [[] for _ in range(n)] if whole else []
    finals: list[RequestOutput | None] = [None] * n
    remaining = n
    async for i, out in run_choices(runner, plan, view, whole=whole):
        if out.error:
            raise ServerFaultError(out.error)
        if out.prompt_progress is not None:
            if progress:
                yield ChatEvent(i, out)
            continue
        post, text = posts[i], out.text
        if whole:
            ev = ChatEvent(i, out)
            texts[i].append(text)
            if post is not None:  # thinking tokens are counted per engine output
                for part in out.part_texts():
                    post.count(part)
        elif post is None:
            ev = ChatEvent(i, out, [TextPiece(text)] if text else [])
        else:
            ev = ChatEvent(i, out, post.feed(text) if text else [])
        if out.finished:
            _finish(ev, post, "".join(texts[i]) if whole else None)
            finals[i], remaining = out, remaining - 1
            if not remaining:
                ev.usage = _usage(plan, [f for f in finals if f is not None], posts)
        yield ev


def _finish(ev: ChatEvent, post: ChoiceOutput | None, whole_text: str | None) -> None:
    """Complete a choice's last event: the held-back pieces (or the whole answer) and its finish."""
    if whole_text is not None:
        ev.answer = post.answer(whole_text) if post is not None else Answer(whole_text)
    elif post is not None:
        ev.pieces += post.finish()
    ev.finish_reason = ev.output.finish_reason
    ev.called_tools = post is not None and post.has_tool_calls
