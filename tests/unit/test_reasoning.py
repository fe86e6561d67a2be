"""Reasoning split, streaming and the thinking budget gate (kvserve.chat.reasoning)."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.chat.reasoning import (
    ReasoningStreamer,
    ThinkingBudget,
    prompt_thinking_tail,
    split_reasoning,
)

# seed 002 Example 12: (output, template opened <think> in the prompt, reasoning, content)
SEED_002 = [
    ("<think>The loop runs n+1 times because of <=.</think>Change `<=` to `<` on line 7.", False,
     "The loop runs n+1 times because of <=.", "Change `<=` to `<` on line 7."),
    ("The loop condition is fine.", False, None, "The loop condition is fine."),
    ("The template already opened the block.</think>Use a StringBuilder.", True,
     "The template already opened the block.", "Use a StringBuilder."),
]

# seed 000 Example 14: prompt ends with "<think>\n"; the model wrote 12 tokens, never "</think>"
SEED_000_PROMPT = "<|endoftext|><｜User｜>Is 7 prime?<｜Assistant｜><think>\n"
SEED_000_TEXT = " creek creek creek creek creek\u2862\u2862\u043b\u0438\u0437\u6a21\u7279\u043b\u0438\u0437\u6a21\u7279\u6a21\u7279"
SEED_000_REASONING = "\n creek creek creek creek creek\u2862\u2862\u043b\u0438\u0437\u6a21\u7279\u043b\u0438\u0437\u6a21\u7279\u6a21\u7279"


def chunkings(text: str):
    yield [text]
    yield list(text)
    for seed in range(20):
        r = random.Random(seed)
        parts, i = [], 0
        while i < len(text):
            j = i + r.randint(1, 6)
            parts.append(text[i:j])
            i = j
        yield parts


def stream(parts, **kw):
    s = ReasoningStreamer(**kw)
    frags = []
    for p in parts:
        frags += s.feed(p)
    frags += s.finish()
    for f in frags:
        assert len(f) == 1 and set(f) <= {"reasoning", "content"} and next(iter(f.values()))
    r = [f["reasoning"] for f in frags if "reasoning" in f]
    return ("".join(r) if r else None), "".join(f.get("content", "") for f in frags), s


@pytest.mark.parametrize("text,opened,reasoning,content", SEED_002)
def test_seed_002_deepseek_r1(text, opened, reasoning, content):
    assert split_reasoning(text, style="deepseek_r1", started_in_prompt=opened) == (reasoning, content)
    for parts in chunkings(text):
        assert stream(parts, style="deepseek_r1", started_in_prompt=opened)[:2] == (reasoning, content)


def test_deepseek_r1_strips_and_keeps_unfinished_as_content():
    text = "<think>\n  a plan \n</think>\n\nThe answer.\n"
    assert split_reasoning(text) == ("a plan", "The answer.")
    for parts in chunkings(text):
        assert stream(parts)[:2] == ("a plan", "The answer.")
    # no end tag: no reasoning, whatever opened it (vLLM's deepseek_r1), streamed or not
    assert split_reasoning("<think>still thinking", started_in_prompt=True) == (None, "<think>still thinking")
    assert split_reasoning("still thinking", started_in_prompt=True) == (None, "still thinking")
    for parts in chunkings("<think>still thinking"):
        assert stream(parts, started_in_prompt=True)[:2] == (None, "<think>still thinking")
    assert split_reasoning("  raw text  ") == (None, "  raw text  ")
    for parts in chunkings("  raw text  "):
        assert stream(parts)[:2] == (None, "  raw text  ")


def test_seed_000_llama_server_formats():
    tail = prompt_thinking_tail(SEED_000_PROMPT)
    assert tail == "\n"
    kw = {"started_in_prompt": True, "prompt_tail": tail}
    assert split_reasoning(SEED_000_TEXT, style="deepseek", **kw) == (SEED_000_REASONING, "")
    assert split_reasoning(SEED_000_TEXT, style="auto", **kw) == (SEED_000_REASONING, "")
    assert split_reasoning(SEED_000_TEXT, style="none", **kw) == (None, "<think>" + SEED_000_REASONING)
    assert split_reasoning(SEED_000_TEXT, style="none", **kw)[1] == (
        "<think>\n creek creek creek creek creek\u2862\u2862\u043b\u0438\u0437\u6a21\u7279\u043b\u0438\u0437"
        "\u6a21\u7279\u6a21\u7279")
    assert split_reasoning(SEED_000_TEXT, style="deepseek-legacy", **kw) == (
        SEED_000_REASONING, "<think>" + SEED_000_REASONING)
    for parts in chunkings(SEED_000_TEXT):
        assert stream(parts, style="deepseek", **kw)[:2] == (SEED_000_REASONING, "")
        assert stream(parts, style="none", **kw)[:2] == (None, "<think>" + SEED_000_REASONING)
        assert stream(parts, style="deepseek-legacy", **kw)[:2] == (SEED_000_REASONING, "<think>" + SEED_000_REASONING)


def test_seed_000_streaming_tokens_and_first_delta():
    tokens = [" creek"] * 5 + ["\u2862", "\u2862", "\u043b\u0438\u0437", "\u6a21\u7279", "\u043b\u0438\u0437",
                                "\u6a21\u7279", "\u6a21\u7279"]
    assert "".join(tokens) == SEED_000_TEXT
    s = ReasoningStreamer(style="deepseek", started_in_prompt=True, prompt_tail="\n")
    assert s.feed(tokens[0]) == [{"reasoning": "\n creek"}]
    assert s.feed(tokens[1]) == [{"reasoning": " creek"}]  # the seed's streamed chunk
    for t in tokens[2:]:
        s.feed(t)
    assert s.finish() == []
    assert s.reasoning_tokens == 12


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>\nabc\n</think>\n\nHello ", "\nabc\n", "Hello "),  # content after the tag loses leading ws
    ("<think>abc", "abc", ""),  # unfinished thinking is reasoning
    ("\n<think>abc</think>x", None, "\n<think>abc</think>x"),  # must start with the tag
    ("abc</think>x", None, "abc</think>x"),  # not opened: all content
])
def test_llama_deepseek_without_prompt(text, reasoning, content):
    assert split_reasoning(text, style="deepseek") == (reasoning, content)
    legacy = split_reasoning(text, style="deepseek-legacy")
    assert legacy == (reasoning, text)
    for parts in chunkings(text):
        assert stream(parts, style="deepseek")[:2] == (reasoning, content)
        assert stream(parts, style="deepseek-legacy")[:2] == (reasoning, text)


@pytest.mark.parametrize("text,enabled,reasoning,content", [
    ("<think>\nabc\n</think>\n\nHello", True, "abc", "Hello"),
    ("abc</think>Hello", True, "abc", "Hello"),  # Qwen3.5 template put <think> in the prompt
    ("cut while thinking", True, "cut while thinking", ""),  # no end tag: all reasoning
    ("Hi there", False, None, "Hi there"),  # enable_thinking false: all content
])
def test_qwen3(text, enabled, reasoning, content):
    assert split_reasoning(text, style="qwen3", thinking_enabled=enabled) == (reasoning, content)
    for parts in chunkings(text):
        assert stream(parts, style="qwen3", thinking_enabled=enabled)[:2] == (reasoning, content)


def test_partial_tags_are_held_back():
    s = ReasoningStreamer(style="deepseek_r1")  # held until the end tag decides
    assert s.feed("<thi") == []
    assert s.feed("nk>Plan") == []
    assert s.feed(" more </th") == []
    assert s.feed("ink> Answer") == [{"reasoning": "Plan more"}, {"content": "Answer"}]
    assert s.feed(" </thin") == [{"content": " </thin"}]  # after the end tag nothing is held
    assert s.finish() == []
    s = ReasoningStreamer(style="deepseek_r1")
    # not opened: held until an end tag makes it reasoning or the output ends as content
    assert s.feed("<b>bold") == []
    assert s.feed(" text") == []
    assert s.finish() == [{"content": "<b>bold text"}]
    s = ReasoningStreamer(style="deepseek_r1")
    assert s.feed("opened by the template") == []
    assert s.feed("</think>Answer") == [{"reasoning": "opened by the template"}, {"content": "Answer"}]
    assert s.reasoning_tokens == 2


def test_reasoning_tokens_count_deltas():
    s = ReasoningStreamer(style="deepseek_r1")
    for t in ["<think>", "a", "b", "</think>", "c", "d"]:
        s.feed(t)
    s.finish()
    assert s.reasoning_tokens == 4  # the tag tokens count as thinking
    s = ReasoningStreamer(style="qwen3", started_in_prompt=True)
    for t in ["a", "b", "</think>", "\n\n", "c"]:
        s.feed(t)
    assert s.reasoning_tokens == 3 and not s.in_reasoning
    s = ReasoningStreamer(style="deepseek_r1")
    for t in ["no", " thinking"]:
        s.feed(t)
    assert s.reasoning_tokens == 0
    s = ReasoningStreamer(style="none", started_in_prompt=True)
    s.feed("a")
    assert s.reasoning_tokens == 0


def test_prompt_thinking_tail():
    assert prompt_thinking_tail("x<think>\n") == "\n"
    assert prompt_thinking_tail("x<think>\n\n</think>\n\n") is None  # enable_thinking false
    assert prompt_thinking_tail("<|im_start|>assistant\n") is None


def test_unknown_style():
    with pytest.raises(ValueError, match="unknown reasoning style 'r1'"):
        split_reasoning("x", style="r1")
    with pytest.raises(ValueError):
        ReasoningStreamer(style="r1")


# ------------------------------------------------------------- vLLM parsers of other model families

GPT_OSS = ("<|channel|>analysis<|message|>The user wants 2+2.<|end|>"
           "<|start|>assistant<|channel|>analysis<|message|>Simple.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>4<|return|>")
GPT_OSS_CALL = ("<|channel|>analysis<|message|>Need the file.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>"
                '{"path":"a"}')


@pytest.mark.parametrize("style,text,kw,reasoning,content", [
    ("glm45", "<think>Check the loop.</think>\nChange `<=` to `<`.", {}, "Check the loop.", "Change `<=` to `<`."),
    ("glm45", "\n<think>\nA</think>", {}, "A", ""),
    ("glm45", "No thinking here.", {}, None, "No thinking here."),
    ("glm45", "The model closed it: A</think>B", {}, None, "The model closed it: A</think>B"),  # both markers needed
    ("granite", "Here is my thought process:\nThe loop runs n+1 times.\nHere is my response:\nUse `<`.", {},
     "The loop runs n+1 times.", "Use `<`."),
    ("granite", "Here's my thought process: short. Here's my response: ok", {}, "short.", "ok"),
    ("granite", "Here is the answer: 4", {}, None, "Here is the answer: 4"),
    ("kimi_k2", "<think>r</think>a", {}, "r", "a"),
    ("kimi_k2", "opened in the prompt</think>a", {}, "opened in the prompt", "a"),
    ("deepseek_v3", "reason</think>answer", {}, "reason", "answer"),
    ("deepseek_v3", "reason</think>answer", {"thinking_enabled": False}, None, "reason</think>answer"),
    ("mistral", "[THINK]Check it.[/THINK]Use `<`.", {}, "Check it.", "Use `<`."),
    ("mistral", "[THINK]cut off", {}, "cut off", ""),
    ("mistral", "Plain.", {}, None, "Plain."),
    ("seed_oss", "<seed:think>Hmm.</seed:think>Yes.", {}, "Hmm.", "Yes."),
    ("seed_oss", "The prompt opened it.</seed:think>Yes.", {}, "The prompt opened it.", "Yes."),
    ("minimax_m2", "<think>a</think>b", {}, "a", "b"),
    ("minimax_m2", "still thinking", {}, "still thinking", ""),
    ("step3", "why</think>because", {}, "why", "because"),
    ("minimax_m2_append_think", "a</think>b", {}, None, "<think>a</think>b"),
    ("openai_gptoss", GPT_OSS, {}, "The user wants 2+2.\nSimple.", "4"),
    ("openai_gptoss", GPT_OSS_CALL, {}, "Need the file.",
     '<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path":"a"}<|call|>'),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off whi", {}, "cut off whi", ""),
    ("openai_gptoss", "plain text, no harmony", {}, None, "plain text, no harmony"),
])
def test_vllm_family_parsers(style, text, kw, reasoning, content):
    assert split_reasoning(text, style=style, **kw) == (reasoning, content)
    for parts in chunkings(text):
        got_r, got_c, _ = stream(parts, style=style, **kw)
        if reasoning is not None or style in ("openai_gptoss", "minimax_m2_append_think", "mistral"):
            assert (got_r, got_c) == (reasoning, content), parts


def test_glm45_after_a_prompt_that_opened_thinking():
    text = "\nThe user asks.</think>\nHello."
    assert split_reasoning(text, style="glm45", started_in_prompt=True) == ("The user asks.", "Hello.")
    for parts in chunkings(text):
        assert stream(parts, style="glm45", started_in_prompt=True)[:2] == ("The user asks.", "Hello.")


def test_marker_style_unclosed_streams_as_reasoning():
    """vLLM's streaming parsers send thinking before the end marker is seen; the finished
    split (both markers needed) makes it content."""
    assert split_reasoning("<think>never closed", style="glm45") == (None, "<think>never closed")
    assert stream(list("<think>never closed"), style="glm45")[:2] == ("never closed", "")


def test_vllm_family_reasoning_tokens():
    s = ReasoningStreamer(style="openai_gptoss")
    pieces = ["<|channel|>analysis<|message|>", "A", "B", "<|end|><|start|>assistant<|channel|>final<|message|>",
              "C"]
    for p in pieces:
        s.feed(p)
    s.finish()
    assert s.reasoning_tokens == 2
    s = ReasoningStreamer(style="glm45")
    for p in ["<think>", "a", "b", "</think>", "c"]:
        s.feed(p)
    assert s.reasoning_tokens == 4


def test_parser_names():
    from kvserve.chat.reasoning import (
        REASONING_PARSERS,
        VLLM_REASONING_PARSERS,
        reasoning_parser_error,
    )

    assert REASONING_PARSERS == ("deepseek_r1", "deepseek_v3", "glm45", "granite", "kimi_k2", "minimax_m2",
                                 "minimax_m2_append_think", "mistral", "openai_gptoss", "qwen3", "seed_oss", "step3")
    assert set(REASONING_PARSERS) <= set(VLLM_REASONING_PARSERS)
    assert reasoning_parser_error("qwen3") is None
    assert reasoning_parser_error("olmo3") == (
        "--reasoning-parser 'olmo3' is a vLLM parser that kvserve does not implement; implemented: deepseek_r1, "
        "deepseek_v3, glm45, granite, kimi_k2, minimax_m2, minimax_m2_append_think, mistral, openai_gptoss, qwen3, "
        "seed_oss, step3")


# ------------------------------------------------------------------------- thinking budget

# fake vocabulary
THINK, END, NL, A, B, LB, RB, LT_SLASH, THINK_GT = range(9)
TEXT = {THINK: "<think>", END: "</think>", NL: "\n", A: "a", B: "b", LB: "{", RB: "}", LT_SLASH: "</",
        THINK_GT: "think>"}
V = 12  # logits width (larger than the vocabulary)


def allowed(mask):
    return None if mask is None else [i for i in range(V) if mask[i]]


class FakeGrammar:
    """Accepts exactly "{" then "}" and is then terminated."""

    def __init__(self):
        self.seq = []

    def mask(self):
        m = torch.zeros(V, dtype=torch.bool)
        if len(self.seq) < 2:
            m[[LB, RB][len(self.seq)]] = True
        return m

    def accept_token(self, t):
        if len(self.seq) < 2 and t == [LB, RB][len(self.seq)]:
            self.seq.append(t)
            return True
        return False

    def is_terminated(self):
        return len(self.seq) == 2


def test_budget_forces_end_tag_after_n_tokens_then_inner():
    g = FakeGrammar()
    b = ThinkingBudget(3, [NL, END], V, started_in_prompt=True, inner=g)
    for t in (A, B, A):
        assert b.mask() is None and b.thinking
        assert b.accept_token(t)
    assert allowed(b.mask()) == [NL]
    assert not b.accept_token(A)  # off the forced path: refused, state unchanged
    assert allowed(b.mask()) == [NL]
    assert b.accept_token(NL)
    assert allowed(b.mask()) == [END]
    assert b.accept_token(END)
    assert b.phase == "answer" and b.forced and b.thinking_tokens == 3
    assert allowed(b.mask()) == [LB] and not b.is_terminated()
    assert b.accept_token(LB) and allowed(b.mask()) == [RB]
    assert b.accept_token(RB) and b.is_terminated()
    assert g.seq == [LB, RB]


def test_budget_zero_forces_at_once_and_minus_one_never():
    b = ThinkingBudget(0, [END], V, started_in_prompt=True)
    assert allowed(b.mask()) == [END]
    assert b.accept_token(END) and b.phase == "answer" and b.mask() is None and not b.is_terminated()
    b = ThinkingBudget(-1, [NL, END], V, started_in_prompt=True, inner=FakeGrammar())
    for _ in range(1000):
        assert b.mask() is None
        b.accept_token(A)
    assert b.thinking and b.thinking_tokens == 1000
    b.accept_token(NL)
    b.accept_token(END)  # the model closed thinking itself
    assert b.phase == "answer" and not b.forced and allowed(b.mask()) == [LB]


def test_model_closing_thinking_stops_counting():
    b = ThinkingBudget(5, [NL, END], V, started_in_prompt=True)
    for t in (A, NL, END):
        b.accept_token(t)
    assert b.phase == "answer" and b.thinking_tokens == 3 and not b.forced
    for _ in range(10):
        assert b.mask() is None and b.accept_token(A)
    assert b.phase == "answer"


def test_end_tag_detected_by_text_across_tokens():
    b = ThinkingBudget(10, [NL, END], V, started_in_prompt=True, token_text=TEXT.__getitem__)
    for t in (A, LT_SLASH, THINK_GT):
        b.accept_token(t)
    assert b.phase == "answer" and not b.forced
    b = ThinkingBudget(10, [NL, END], V, started_in_prompt=True)  # ids only: not detected
    for t in (A, LT_SLASH, THINK_GT):
        b.accept_token(t)
    assert b.thinking


def test_output_may_open_thinking_itself():
    g = FakeGrammar()
    b = ThinkingBudget(2, [END], V, started_in_prompt=False, start_tag_ids=[THINK], inner=g)
    assert allowed(b.mask()) == [THINK, LB]  # the grammar's first token or the start tag
    assert b.accept_token(THINK) and b.thinking
    b.accept_token(A)
    b.accept_token(B)
    assert allowed(b.mask()) == [END]
    b.accept_token(END)
    assert allowed(b.mask()) == [LB]
    # not opened: the first token goes to the grammar, no thinking at all
    g = FakeGrammar()
    b = ThinkingBudget(2, [END], V, started_in_prompt=False, start_tag_ids=[THINK], inner=g)
    assert b.accept_token(LB) and b.phase == "answer" and g.seq == [LB]
    assert allowed(b.mask()) == [RB]
    # multi-token start tag: the rest is forced once begun (with a grammar)
    b = ThinkingBudget(1, [END], V, started_in_prompt=False, start_tag_ids=[LT_SLASH, THINK_GT],
                       inner=FakeGrammar())
    b.accept_token(LT_SLASH)
    assert allowed(b.mask()) == [THINK_GT] and not b.accept_token(A)
    assert b.accept_token(THINK_GT) and b.mask() is None
    # no start tag known and not opened by the prompt: straight to the answer
    b = ThinkingBudget(5, [END], V, started_in_prompt=False)
    assert b.phase == "answer" and b.mask() is None and b.accept_token(A)


def test_budget_arguments_checked():
    with pytest.raises(ValueError):
        ThinkingBudget(-2, [END], V, started_in_prompt=True)
    with pytest.raises(ValueError):
        ThinkingBudget(1, [], V, started_in_prompt=True)


def test_eog_is_banned_while_thinking_only_when_an_answer_is_owed():
    EOG = 11
    b = ThinkingBudget(-1, [NL, END], V, started_in_prompt=True, inner=FakeGrammar(), eog_token_ids=[EOG, 99])
    assert allowed(b.mask()) == [i for i in range(V) if i != EOG]
    b.accept_token(A)
    assert allowed(b.mask()) == [i for i in range(V) if i != EOG]
    b.accept_token(NL)
    b.accept_token(END)
    assert allowed(b.mask()) == [LB]  # the answer's grammar takes over
    b = ThinkingBudget(-1, [NL, END], V, started_in_prompt=True, inner=None, eog_token_ids=[EOG])
    assert b.mask() is None  # nothing owed: the model may stop while thinking
