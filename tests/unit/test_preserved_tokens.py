"""Preserved control tokens (llama-server ``preserved_tokens``) and vLLM's ``skip_special_tokens``.

A tiny GGUF whose vocabulary has Kimi K2's and gpt-oss harmony's markers as control tokens
(ids 301..312) is forced, token by token, to write a call; the detokenizer must render exactly
the markers of the request's parsers, the parsers must turn them into ``tool_calls`` (whole and
streamed), and without a parser the same tokens stay hidden.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.request import Request, SamplingParams
from kvserve.serving.chat_output import (
    Answer,
    ChoiceOutput,
    OutputMode,
    ReasoningPiece,
    TextPiece,
    ToolCallPiece,
    marker_texts,
    preserved_token_ids,
)
from kvserve.faces.api_error import ApiError
from kvserve.faces.openai import _special_tokens
from kvserve.loaders.tokenizer import Tokenizer
from kvserve.models.build import load_files

KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>")
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
EXTRA = KIMI + HARMONY  # ids 301..312 (the tiny vocab has 301 tokens)
KIMI_IDS = frozenset(range(301, 306))
HARMONY_IDS = frozenset(range(306, 313))
#: <|start|> <|channel|> <|message|> <|constrain|> and harmony's <|end|> are user-defined tokens whatever
#: the file says, as llama.cpp makes them (llama-vocab.cpp): matched in text, always rendered; only
#: <|call|> and <|return|> stay control tokens for the preserved-token machinery
HARMONY_USER_DEFINED = frozenset(range(306, 311))
HARMONY_CONTROL = HARMONY_IDS - HARMONY_USER_DEFINED

KIMI_TEXT = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0'
             '<|tool_call_argument_begin|>{"path": "a.txt"}<|tool_call_end|><|tool_calls_section_end|>')
HARMONY_TEXT = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.read_file <|constrain|>json<|message|>{"path":"a.txt"}<|call|>')


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    import tinymodel

    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("preserve") / "m.gguf",
                                         extra_control_tokens=EXTRA))


@pytest.fixture(scope="module")
def tok(gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(gguf)


@pytest.fixture(scope="module")
def core(gguf) -> EngineCore:
    return EngineCore(load_files(gguf), EngineConfig(n_ctx=512, dtype="float32", n_parallel=2))


class _Force:
    """Constraint that allows exactly the next token of a script (never terminates itself)."""

    def __init__(self, n_vocab: int, ids: list[int]):
        self.n_vocab, self.ids, self.k = n_vocab, ids, 0

    def mask(self):
        m = torch.zeros(self.n_vocab, dtype=torch.bool)
        m[self.ids[min(self.k, len(self.ids) - 1)]] = True
        return m

    def accept_token(self, token_id: int) -> bool:
        self.k += 1
        return True

    def is_terminated(self) -> bool:
        return False


def _generate(core: EngineCore, ids: list[int], **params) -> tuple[list[str], list[int], str]:
    """Force ``ids`` through the real engine; (text deltas, token ids, stop_type)."""
    p = SamplingParams(n_predict=len(ids), temperature=0.0, **params)
    req = Request(f"r{id(p)}", core.tokenizer.encode("hi", add_special=False), p,
                  grammar=_Force(core.model_config.n_vocab, ids))
    core.add_request(req)
    deltas, toks, stop = [], [], None
    while stop is None:
        for o in core.step():
            deltas.append(o.text)
            toks += o.new_token_ids
            if o.finished:
                stop = o.stop_type
    return deltas, toks, stop


def _stream(mode: OutputMode, deltas: list[str]) -> dict:
    co = ChoiceOutput(mode)
    out: dict = {"content": "", "reasoning": "", "calls": []}
    for p in [x for piece in deltas for x in co.feed(piece)] + co.finish():
        if isinstance(p, TextPiece):
            out["content"] += p.text
        elif isinstance(p, ReasoningPiece):
            out["reasoning"] += p.text
        else:
            out["calls"].append((p.name, p.arguments))
    out["has_tool_calls"] = co.has_tool_calls
    return out


# -- which ids are preserved ---------------------------------------------------------------------


def test_vocab_has_the_markers_as_single_control_tokens(tok):
    ids = tok.encode("".join(EXTRA), add_special=False, parse_special=True)
    assert ids == list(range(301, 313))
    assert [i for i in ids if tok.is_control(i)] == [*sorted(KIMI_IDS), *sorted(HARMONY_CONTROL)]
    assert tok.token_bytes(301, special=False) == b""


def test_preserved_ids_per_mode(tok):
    assert preserved_token_ids(tok, OutputMode(tool_parser="kimi_k2")) == KIMI_IDS
    assert preserved_token_ids(tok, OutputMode(tool_parser="openai", reasoning_style="openai_gptoss")) == HARMONY_CONTROL
    # the reasoning parser alone needs the harmony markers too (the user-defined ones always render)
    assert preserved_token_ids(tok, OutputMode(reasoning_style="openai_gptoss")) == HARMONY_CONTROL
    # <think> is several plain tokens here; hermes' markers likewise: nothing to preserve
    assert preserved_token_ids(tok, OutputMode(tool_parser="hermes", reasoning_style="deepseek")) == frozenset()
    assert preserved_token_ids(tok, OutputMode()) == frozenset()
    assert marker_texts(OutputMode(tool_parser="hermes", reasoning_style="deepseek")) == (
        "</think>", "</tool_call>", "<think>", "<tool_call>")
    assert marker_texts(OutputMode(tool_parser="mistral", reasoning_style="mistral")) == (
        "[/THINK]", "[ARGS]", "[CALL_ID]", "[THINK]", "[TOOL_CALLS]")


# -- the detokenizer ---------------------------------------------------------------------------


def _detok(tok, ids, **kw) -> str:
    d = IncrementalDetokenizer(tok, **kw)
    return "".join(d.add(i)[0] for i in ids) + d.flush()


def test_detokenizer_renders_preserved_ids_only(tok):
    ids = [1] + tok.encode("ab", add_special=False) + [302, 307, 2]  # <|im_start|> ab <|tool_call_begin|> <|channel|> <|im_end|>
    # <|channel|> is user-defined (llama.cpp's rule): rendered with or without a parser
    assert _detok(tok, ids) == "ab<|channel|>"
    assert _detok(tok, ids, preserved=KIMI_IDS) == "ab<|tool_call_begin|><|channel|>"
    assert _detok(tok, ids, preserved=HARMONY_IDS) == "ab<|channel|>"
    assert _detok(tok, ids, include_control=True) == "<|im_start|>ab<|tool_call_begin|><|channel|><|im_end|>"


def test_preserved_marker_meets_stop_strings(tok):
    d = IncrementalDetokenizer(tok, ("<|tool_call_end|>",), preserved=KIMI_IDS)
    assert d.add(tok.encode("x", add_special=False)[0]) == ("x", None)
    assert d.add(304) == ("", "<|tool_call_end|>")
    assert d.text == "x" and d.stop_string == "<|tool_call_end|>"
    # hidden, the same token cannot match the stop string
    d = IncrementalDetokenizer(tok, ("<|tool_call_end|>",))
    assert d.add(304) == ("", None) and not d.finished


def test_for_params(tok):
    p = SamplingParams(stop=("zz",), preserved_token_ids=frozenset({301}))
    d = IncrementalDetokenizer.for_params(tok, p)
    assert [d.add(i)[0] for i in (301, 302)] == ["<|tool_calls_section_begin|>", ""]
    d = IncrementalDetokenizer.for_params(tok, SamplingParams(skip_special_tokens=False))
    assert [d.add(i)[0] for i in (301, 0)] == ["<|tool_calls_section_begin|>", "<|endoftext|>"]


# -- through the engine and the chat parsers ------------------------------------------------------


def test_kimi_call_parsed_whole_and_streamed(core, tok):
    ids = tok.encode(KIMI_TEXT, add_special=False, parse_special=True)
    assert len(ids) == 46 and ids[6:8] == [301, 302]
    mode = OutputMode(tool_parser="kimi_k2")
    deltas, toks, stop = _generate(core, ids, preserved_token_ids=preserved_token_ids(tok, mode))
    assert toks == ids and stop == "limit"
    text = "".join(deltas)
    assert text == KIMI_TEXT
    ans = ChoiceOutput(mode).answer(text)
    assert ans.text == "Checking."
    assert ans.tool_calls == [ToolCallPiece(0, "functions.read_file:0", "read_file", '{"path": "a.txt"}')]
    s = _stream(mode, deltas)
    assert (s["content"], s["calls"], s["has_tool_calls"]) == ("Checking.", [("read_file", '{"path": "a.txt"}')], True)


def test_kimi_markers_hidden_without_parser(core, tok):
    ids = tok.encode(KIMI_TEXT, add_special=False, parse_special=True)
    deltas, _, _ = _generate(core, ids)  # no parser: nothing preserved
    text = "".join(deltas)
    assert text == 'Checking.functions.read_file:0{"path": "a.txt"}'
    assert ChoiceOutput(OutputMode(tool_parser="kimi_k2")).answer(text) == Answer(text, None, [])
    # skip_special_tokens=False: every control token, the parser's or not
    deltas, _, _ = _generate(core, [1] + ids[:8], skip_special_tokens=False)
    assert "".join(deltas) == "<|im_start|>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"


def test_harmony_call_and_reasoning(core, tok):
    ids = tok.encode(HARMONY_TEXT, add_special=False, parse_special=True)
    assert len(ids) == 73 and ids[-1] == 311 and 311 in core.tokenizer.eog_token_ids  # <|call|> ends generation
    mode = OutputMode(tool_parser="openai", reasoning_style="openai_gptoss")
    deltas, toks, stop = _generate(core, ids, preserved_token_ids=preserved_token_ids(tok, mode))
    assert toks == ids and stop == "eos"
    text = "".join(deltas)
    assert text == HARMONY_TEXT[: -len("<|call|>")]
    ans = ChoiceOutput(mode).answer(text)
    assert ans.reasoning == "Need it."
    assert not ans.text
    assert [(c.name, c.arguments) for c in ans.tool_calls] == [("read_file", '{"path": "a.txt"}')]
    s = _stream(mode, deltas)
    assert (s["reasoning"], s["content"], s["calls"]) == ("Need it.", "", [("read_file", '{"path": "a.txt"}')])


def test_unconsumed_marker_stays_in_content(core, tok):
    # a preserved marker the parser does not expect (no section opened) is content, as llama-server
    ids = tok.encode("ok<|tool_call_end|>", add_special=False, parse_special=True)
    mode = OutputMode(tool_parser="kimi_k2")
    deltas, _, _ = _generate(core, ids, preserved_token_ids=preserved_token_ids(tok, mode))
    assert ChoiceOutput(mode).answer("".join(deltas)).text == "ok<|tool_call_end|>"


# -- the request fields -------------------------------------------------------------------------


def test_special_tokens_fields():
    base = SamplingParams()
    assert _special_tokens({}, base) is base
    p = _special_tokens({"skip_special_tokens": False}, base)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.preserved_token_ids) == (False, True, frozenset())
    p = _special_tokens({"spaces_between_special_tokens": False}, base, frozenset({5}))
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.preserved_token_ids) == (True, False,
                                                                                              frozenset({5}))
    with pytest.raises(ApiError) as e:
        _special_tokens({"skip_special_tokens": "no"}, base)
    assert e.value.status == 400
    assert dataclasses.replace(base).preserved_token_ids == frozenset()
