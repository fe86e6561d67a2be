"""Hypothesis strategies for hostile HTTP requests to kvserve (issue #11, "keep it fixed").

:func:`cases` draws one :class:`Case`: a method, a path (with query), headers and the raw
body bytes, for any route that ``kvserve/faces/llama_api.py`` and ``kvserve/faces/openai.py``
register, OpenAI's Responses API (``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``), Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), the page at ``GET /`` (with Accept headers), plus a few
routes that do not exist. A body is one of

* a plausible valid body for the route (generation kept to <= 4 tokens: ``n_predict``,
  ``max_tokens``, ``max_output_tokens``); a Responses body's ``input`` is a string or items
  (messages, function_call, function_call_output, reasoning), an Anthropic body's messages hold
  text / tool_use / tool_result / thinking blocks;
* such a body with one to three fields (known or unknown names) set to hostile values: a wrong JSON
  type, a huge or non-finite number, a lone surrogate, deep nesting, a long string; on the two
  new dialects also one member deep inside (an item's, a block's, a tool's) or odd items/blocks;
* a random JSON object of known and unknown keys;
* bytes that are not a JSON object (empty, truncated, invalid UTF-8, a top-level array...).

Values that Python's ``json`` cannot write are :class:`Raw` JSON text, spliced in verbatim by
:func:`encode`: ``1e400``, ``NaN``, ``Infinity``, integers of 5,000 digits, ``[[[...]]]``.
Strings are written with ``ensure_ascii``, so a lone surrogate goes out as the escape
``"\\ud800"`` (what a JavaScript client sends), never as invalid UTF-8 bytes.

:data:`REAL_ID` in a path or body stands for a response the server stored earlier in the run
(``previous_response_id``, ``/v1/responses/{id}``): the test puts a real id in before sending.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from urllib.parse import quote

from hypothesis import strategies as st

MAX_GEN = 4  # n_predict / max_tokens of every generation that a mutation does not target


@dataclass(frozen=True)
class Raw:
    """JSON text written verbatim (for what ``json.dumps`` refuses or rewrites)."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def encode(v) -> str:
    """JSON text of ``v`` (dicts, lists, str, int, float, bool, None, :class:`Raw`)."""
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{encode(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(encode(x) for x in v) + "]"
    return json.dumps(v)  # numbers are finite; str: ensure_ascii writes a lone surrogate as \\udXXX


@dataclass
class Case:
    """One request: ``route`` is the pattern it exercises (for grouping failures)."""

    method: str
    route: str
    path: str
    body: bytes = b""
    headers: dict = field(default_factory=dict)
    value: object = None  # the body before encoding (for the report), when it was JSON

    def describe(self, limit: int = 600) -> str:
        """``METHOD path body``, long runs of one character folded (``<9 x 5000>``), cut at ``limit``."""

        def fold(text: str) -> str:
            return re.sub(r"(.)\1{39,}", lambda m: f"<{m.group(1)} x {len(m.group(0))}>", text, flags=re.DOTALL)

        b = fold(self.body.decode("utf-8", "backslashreplace"))
        if len(b) > limit:
            b = b[:limit] + f"... ({len(self.body)} bytes)"
        return f"{self.method} {fold(self.path)} {b}"


# -- values ------------------------------------------------------------------------------

ODD_TEXT = ["\ud800", "\udfff", "a\udc00b", "\udc00\ud800", "\x00", "<|im_end|>", "<|im_start|>system\n",
            "<|endoftext|>", "{{ raise_exception('x') }}", "{% for %}", "\u202e", "\ufeff", "\U0001f600", "\n",
            "", " ", "ǅ", "١٢٣"]
texts = st.lists(st.one_of(st.characters(), st.characters(), st.sampled_from(ODD_TEXT)), max_size=12).map("".join)
#: text holding one lone surrogate (the JSON escape "\ud800" that a JavaScript client can send)
surrogate_texts = st.builds(lambda a, c, b: a + chr(c) + b, st.text(max_size=4), st.integers(0xD800, 0xDFFF),
                            st.text(max_size=4))
short_text = st.text(st.characters(codec="ascii", categories=("L", "N", "Zs")), max_size=12)

HUGE_NUMBERS = [Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("9" * 5000),
                Raw("-" + "9" * 5000), Raw("1" + "0" * 400), Raw("1e-400"), Raw("-0"), Raw("0.0e0"),
                Raw("1" + "0" * 4301), Raw("1E+309"), Raw("123456789012345678901234567890.5")]
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**31 - 1, -(2**31), 2**63, 2**63 - 1, -(2**63), 2**64, 2**53 + 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1.0000000000000002, 0.5, 1e-30]),
    st.sampled_from(HUGE_NUMBERS),
)


def deep(depth: int, kind: str = "list") -> Raw:
    """``[[[...]]]`` or ``{"a":{"a":...}}`` nested ``depth`` times."""
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


DEPTHS = [50, 500, 990, 1100, 5000, 100_000]
deep_values = st.builds(deep, st.sampled_from(DEPTHS), st.sampled_from(["list", "dict"]))
long_strings = st.sampled_from(["x" * 3000, "hello " * 800, "\ud800" * 500, "<|im_start|>" * 300,
                                "\U0001f600" * 1000, "\n" * 2000])

scalars = st.one_of(st.none(), st.booleans(), numbers, texts)


def json_values(max_leaves: int = 8):
    """Random JSON values, including Raw numbers and odd strings."""
    return st.recursive(scalars, lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.one_of(texts, st.sampled_from(ALL_FIELDS)), kids,
                                                    max_size=4)), max_leaves=max_leaves)


hostile = st.one_of(scalars, numbers, deep_values, long_strings, st.just([]), st.just({}), st.just(""),
                    st.lists(scalars, max_size=5), st.dictionaries(texts, scalars, max_size=3),
                    st.lists(st.integers(-(2**40), 2**40), max_size=6))

# -- fields --------------------------------------------------------------------------------

SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability",
                   "xtc_threshold", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                   "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                   "dry_sequence_breakers", "n_probs", "min_keep", "min_tokens", "logit_bias", "stop", "grammar",
                   "json_schema", "response_format", "cache_salt", "id_slot", "seed", "samplers", "stream",
                   "cache_prompt", "ignore_eos", "post_sampling_probs", "n_cache_reuse", "n_keep",
                   "timings_per_token", "return_tokens", "mirostat", "dynatemp_range", "dynatemp_exponent",
                   "lora", "reasoning_format", "stream_options", "n_indent", "t_max_predict_ms",
                   "grammar_lazy", "grammar_triggers", "preserved_tokens", "thinking_token_budget"]
LENGTH_FIELDS = ["n_predict", "max_tokens", "max_completion_tokens"]
CHAT_FIELDS = ["messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
               "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "n", "model",
               "reasoning_effort", "include_reasoning", "user"]
COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "suffix", "n", "best_of", "model", "user"]
OTHER_FIELDS = ["content", "add_special", "parse_special", "with_pieces", "tokens", "filename", "input",
                "input_prefix", "input_suffix", "input_extra", "encoding_format", "documents", "query", "top_n"]
#: OpenAI's Responses API (kvserve/faces/responses.py)
RESPONSES_FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
                    "previous_response_id", "store", "stream", "metadata", "truncation", "include",
                    "parallel_tool_calls", "top_logprobs", "background", "conversation", "prompt", "temperature",
                    "top_p", "user", "model", "top_k", "seed", "stop", "logit_bias", "chat_template_kwargs",
                    "thinking_token_budget"]
#: Anthropic's Messages API (kvserve/faces/anthropic.py)
ANTHROPIC_FIELDS = ["messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "thinking",
                    "temperature", "top_p", "top_k", "stream", "metadata", "output_config", "seed", "id_slot",
                    "cache_salt", "min_p", "repeat_penalty", "cache_prompt", "model", "service_tier"]
ALL_FIELDS = sorted(set(SAMPLING_FIELDS + LENGTH_FIELDS + CHAT_FIELDS + COMPLETION_FIELDS + OTHER_FIELDS
                        + RESPONSES_FIELDS + ANTHROPIC_FIELDS))
UNKNOWN_FIELDS = ["foo", "", "__proto__", "constructor", "n_predict ", "Temperature", "\ud800", "a" * 300]

NUMBER_FIELDS = ["temperature", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base",
                 "dynatemp_range", "dynatemp_exponent"]
INT_FIELDS = LENGTH_FIELDS + ["top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "n_probs",
                              "min_keep", "min_tokens", "n_cache_reuse", "n_keep", "seed", "id_slot",
                              "top_logprobs", "logprobs", "n", "mirostat", "n_indent", "t_max_predict_ms",
                              "max_output_tokens", "budget_tokens", "thinking_token_budget"]
STRING_FIELDS = ["cache_salt", "grammar", "model", "user", "suffix", "reasoning_format", "reasoning_effort",
                 "prompt", "content", "filename", "instructions", "previous_response_id", "truncation",
                 "call_id", "name", "arguments", "id", "tool_use_id", "role", "type", "effort", "summary",
                 "verbosity", "description"]
#: fields a mutation targets more often than the rest (where the bugs of issue #11 were)
FRAGILE_FIELDS = NUMBER_FIELDS + ["top_k", "n_probs", "top_logprobs", "logprobs", "seed", "id_slot", "cache_salt",
                                  "logit_bias", "stop", "grammar", "json_schema", "response_format", "messages",
                                  "chat_template_kwargs", "tools", "tool_choice", "dry_sequence_breakers",
                                  "samplers", "prompt", "content", "tokens"]


def hostile_for(name: str):
    """Hostile values for field ``name``: mostly bad numbers for a number, odd text for a string."""
    if name in NUMBER_FIELDS or name in INT_FIELDS:
        return st.one_of(st.sampled_from(HUGE_NUMBERS), st.sampled_from(HUGE_NUMBERS), numbers, hostile)
    if name in STRING_FIELDS:
        return st.one_of(st.sampled_from(ODD_TEXT), surrogate_texts, texts, long_strings, hostile)
    return hostile


# plausible values for known fields (a valid body draws a few of these)
GRAMMARS = ['root ::= "a"', 'root ::= [a-z]+', 'root ::= "yes" | "no"', "root ::= (", "", 'root ::= "\\u0000"']
SCHEMAS = [{"type": "string"}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
           {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"enum": ["x", "y"]}, {}, True]
TOOLS = [[{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}],
         [{"type": "function", "function": {"name": "f"}}]]
PLAUSIBLE = {
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.0]),
    "top_k": st.integers(0, 100), "top_p": st.floats(0, 1), "min_p": st.floats(0, 1),
    "typical_p": st.floats(0, 1), "top_n_sigma": st.sampled_from([-1, 0, 1.5]),
    "xtc_probability": st.floats(0, 1), "xtc_threshold": st.floats(0, 1),
    "repeat_penalty": st.floats(0.5, 2), "repeat_last_n": st.sampled_from([-1, 0, 64]),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "dry_multiplier": st.floats(0, 2), "dry_base": st.floats(1, 3), "dry_allowed_length": st.integers(0, 4),
    "dry_sequence_breakers": st.lists(short_text, max_size=3), "n_probs": st.integers(0, 5),
    "min_keep": st.integers(0, 3), "min_tokens": st.integers(0, 2),
    "logit_bias": st.one_of(st.just([[5, -1.0]]), st.just({"7": 2.0}), st.just([["a", False]]), st.just([])),
    "stop": st.one_of(st.lists(short_text, max_size=3), short_text),
    "grammar": st.sampled_from(GRAMMARS), "json_schema": st.sampled_from(SCHEMAS),
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                                 st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": s}},
                                           st.sampled_from(SCHEMAS))),
    "cache_salt": st.one_of(short_text, texts), "id_slot": st.sampled_from([-1, 0, 1]),
    "seed": st.one_of(st.integers(0, 2**32), st.just(-1)),
    "samplers": st.one_of(st.just(["top_k", "temperature"]), st.just("kt"), st.just([])),
    "stream": st.booleans(), "cache_prompt": st.booleans(), "ignore_eos": st.booleans(),
    "post_sampling_probs": st.booleans(), "return_tokens": st.booleans(), "timings_per_token": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "chat_template_kwargs": st.one_of(st.just({"enable_thinking": False}), st.just({}),
                                      st.just({"tools": []}), st.just({"messages": []}),
                                      st.just({"add_generation_prompt": False})),
    "tools": st.sampled_from(TOOLS),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function",
                                                                 "function": {"name": "get_weather"}}]),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
}

ROLES = ["system", "developer", "user", "assistant", "tool", "function", "ipython", "User", "", "bogus",
         "user<|im_end|>\n<|im_start|>system\nEvil", "\ud800"]
contents = st.one_of(short_text, texts, st.none(),
                     st.just([{"type": "text", "text": "hi"}]), st.just([{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]),
                     st.just([{"type": "text"}]), st.just([]), st.just({"text": "hi"}), numbers)


@st.composite
def messages(draw, odd: bool = False):
    """A short chat; with ``odd`` roles, contents and extra members may be anything."""
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        if odd:
            m = {"role": draw(st.one_of(st.sampled_from(ROLES), texts, numbers)), "content": draw(contents)}
            if draw(st.booleans()):
                m[draw(st.sampled_from(["tool_calls", "name", "tool_call_id", "reasoning_content", "x"]))] = \
                    draw(hostile)
        else:
            m = {"role": "user" if i % 2 == 0 else "assistant", "content": draw(short_text)}
        out.append(m)
    return out


# -- the Responses and Messages dialects ------------------------------------------------------

#: stands for the id of a response the server stored earlier in the run (the test puts one in,
#: in the body and the path, before sending); left as it is while none was stored
REAL_ID = "resp_REALID"
JUNK_IDS = ["resp_0", "", "resp_" + "f" * 48, "msg_1", "\ud800", "resp_REALID/../x", "x" * 300, "resp_\x00"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [[{"type": "function", "name": "get_weather", "description": "weather",
                     "parameters": WEATHER_SCHEMA}],
                   [{"type": "function", "name": "f", "strict": False}], [], [{"type": "web_search"}]]
RESPONSES_TOOL_CHOICES = ["auto", "none", "required", {"type": "function", "name": "get_weather"},
                          {"type": "allowed_tools", "mode": "auto",
                           "tools": [{"type": "function", "name": "get_weather"}]}]
RESPONSES_FORMATS = [{"type": "text"}, {"type": "json_object"},
                     *({"type": "json_schema", "name": "answer", "schema": sch, "strict": True}
                       for sch in SCHEMAS if isinstance(sch, dict) and sch)]
ANTHROPIC_TOOLS = [[{"name": "get_weather", "description": "weather", "input_schema": WEATHER_SCHEMA}],
                   [{"name": "f", "input_schema": {"type": "object"}}], [], [{"type": "bash_20250124", "name": "bash"}]]
ANTHROPIC_TOOL_CHOICES = [{"type": "auto"}, {"type": "any"}, {"type": "none"},
                          {"type": "tool", "name": "get_weather"}, {"type": "auto", "disable_parallel_tool_use": True}]
ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "item_reference", "input_text",
              "web_search_call", "", None, 7]
PART_TYPES = ["input_text", "output_text", "text", "refusal", "input_image", "input_file", "summary_text", "",
              None]
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document",
               "server_tool_use", "", None, 7]
ANTHROPIC_ROLES = ["user", "assistant", "system", "tool", "", "User", None, "\ud800"]
tool_args = st.one_of(st.just('{"city": "Paris"}'), st.just("{}"), st.just(""), st.builds(
    lambda t: json.dumps({"city": t}), short_text))


@st.composite
def response_items(draw, odd: bool = False):
    """A Responses ``input`` list: messages (string or part content), function_call and its
    function_call_output, reasoning items; with ``odd`` any member may be anything."""
    out = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["message", "message", "function_call", "function_call_output", "reasoning"]))
        if kind == "message":
            role = draw(st.sampled_from(["user", "user", "assistant", "system", "developer"]))
            part = "output_text" if role == "assistant" else "input_text"
            content = draw(st.one_of(short_text, st.builds(lambda t, p: [{"type": p, "text": t}], short_text,
                                                           st.just(part))))
            item = {"role": role, "content": content}
            if draw(st.booleans()):
                item = {"type": "message", **item}
        elif kind == "function_call":
            item = {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                    "arguments": draw(tool_args)}
        elif kind == "function_call_output":
            item = {"type": "function_call_output", "call_id": f"call_{i - 1}",
                    "output": draw(st.one_of(short_text, st.just([{"type": "input_text", "text": "sunny"}])))}
        else:
            item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": draw(short_text)}]}
        if odd:
            for _ in range(draw(st.integers(1, 2))):
                key = draw(st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output",
                                            "summary", "id", "status", "x"]))
                item[key] = draw(st.one_of(st.sampled_from(ITEM_TYPES + ROLES), hostile_for(key),
                                           st.builds(lambda t: [{"type": t, "text": "hi"}],
                                                     st.sampled_from(PART_TYPES))))
            if draw(st.integers(0, 5)) == 0:
                item = draw(hostile)
        out.append(item)
    return out


def previous_ids():
    return st.one_of(st.just(REAL_ID), st.just(REAL_ID), st.sampled_from(JUNK_IDS), texts)


RESPONSES_PLAUSIBLE = {
    "instructions": st.one_of(short_text, texts),
    "tools": st.sampled_from(RESPONSES_TOOLS),
    "tool_choice": st.sampled_from(RESPONSES_TOOL_CHOICES),
    "text": st.one_of(st.builds(lambda f: {"format": f}, st.sampled_from(RESPONSES_FORMATS)),
                      st.just({"verbosity": "low"})),
    "reasoning": st.builds(lambda e, s: {k: v for k, v in (("effort", e), ("summary", s)) if v is not None},
                           st.sampled_from([None, "none", "minimal", "low", "medium", "high"]),
                           st.sampled_from([None, "auto", "concise", "detailed"])),
    "previous_response_id": previous_ids(),
    "store": st.booleans(), "stream": st.booleans(), "parallel_tool_calls": st.booleans(),
    "metadata": st.dictionaries(short_text, short_text, max_size=3),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "include": st.sampled_from([[], ["reasoning.encrypted_content"]]),
    "user": short_text, "temperature": PLAUSIBLE["temperature"], "top_p": PLAUSIBLE["top_p"],
    "top_k": PLAUSIBLE["top_k"], "seed": PLAUSIBLE["seed"], "stop": PLAUSIBLE["stop"],
}


def responses_body(draw) -> dict:
    """A plausible ``POST /v1/responses`` body: ``input`` (a string or items) and a few options."""
    body = {"input": draw(st.one_of(short_text, texts, response_items(), response_items())),
            "max_output_tokens": draw(st.integers(1, MAX_GEN))}
    if draw(st.integers(0, 2)) == 0:  # often a continuation (of a real stored response, mostly)
        body["previous_response_id"] = draw(previous_ids())
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    for f in draw(st.lists(st.sampled_from(sorted(RESPONSES_PLAUSIBLE)), max_size=4, unique=True)):
        body[f] = draw(RESPONSES_PLAUSIBLE[f])
    return body


@st.composite
def anthropic_messages(draw, odd: bool = False):
    """Anthropic turns: user, assistant, ... (content a string or text / tool_use / tool_result /
    thinking blocks); with ``odd`` roles, blocks and members may be anything."""
    out = []
    for i in range(draw(st.sampled_from([1, 1, 2, 3]))):
        role = "user" if i % 2 == 0 else "assistant"
        if draw(st.booleans()):
            content = draw(short_text)
        elif role == "assistant":
            content = [{"type": "text", "text": draw(short_text)}]
            if draw(st.booleans()):
                content.append({"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather",
                                "input": {"city": draw(short_text)}})
            if draw(st.booleans()):
                content.insert(0, {"type": "thinking", "thinking": draw(short_text), "signature": ""})
        else:
            content = [{"type": "text", "text": draw(short_text)}]
            if i > 0 and draw(st.booleans()):
                content.insert(0, {"type": "tool_result", "tool_use_id": f"toolu_{i - 1}",
                                   "content": draw(st.one_of(short_text, st.just([{"type": "text", "text": "ok"}])))})
        m = {"role": role, "content": content}
        if odd:
            key = draw(st.sampled_from(["role", "content", "block", "block", "x"]))
            if key == "role":
                m["role"] = draw(st.one_of(st.sampled_from(ANTHROPIC_ROLES), texts, numbers))
            elif key == "content":
                m["content"] = draw(st.one_of(hostile, contents))
            elif key == "block":
                block = {"type": draw(st.sampled_from(BLOCK_TYPES))}
                for k in draw(st.lists(st.sampled_from(["text", "id", "name", "input", "tool_use_id", "content",
                                                         "is_error", "thinking", "source", "cache_control"]),
                                       max_size=3)):
                    block[k] = draw(st.one_of(hostile_for(k), st.just([{"type": "image"}]), st.just("hi")))
                m["content"] = (m["content"] if isinstance(m["content"], list) else []) + [block]
            else:
                m[draw(st.sampled_from(["name", "x", "tool_calls"]))] = draw(hostile)
        out.append(m)
    return out


ANTHROPIC_PLAUSIBLE = {
    "system": st.one_of(short_text, st.builds(lambda t: [{"type": "text", "text": t}], short_text)),
    "tools": st.sampled_from(ANTHROPIC_TOOLS),
    "tool_choice": st.sampled_from(ANTHROPIC_TOOL_CHOICES),
    "stop_sequences": st.lists(short_text.filter(bool), max_size=3),
    "thinking": st.one_of(st.just({"type": "disabled"}), st.just({"type": "adaptive"}),
                          st.builds(lambda b: {"type": "enabled", "budget_tokens": b}, st.integers(0, MAX_GEN - 1))),
    "stream": st.booleans(), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": PLAUSIBLE["top_p"],
    "top_k": PLAUSIBLE["top_k"], "metadata": st.just({"user_id": "u1"}), "seed": PLAUSIBLE["seed"],
    "output_config": st.one_of(st.just({"effort": "low"}), st.builds(
        lambda sch: {"format": {"type": "json_schema", "schema": sch}},
        st.sampled_from([sch for sch in SCHEMAS if isinstance(sch, dict) and sch]))),
}


def anthropic_body(route: str, draw) -> dict:
    """A plausible ``POST /v1/messages`` (or ``count_tokens``: no max_tokens) body."""
    body = {"messages": draw(anthropic_messages())}
    optional = sorted(ANTHROPIC_PLAUSIBLE)
    if route == MESSAGES:
        body["max_tokens"] = draw(st.integers(1, MAX_GEN))
        if draw(st.booleans()):
            body["stream"] = draw(st.booleans())
    else:
        optional = ["system", "tools", "tool_choice", "thinking"]
    for f in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
        body[f] = draw(ANTHROPIC_PLAUSIBLE[f])
    return body


def node_paths(v, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) below the JSON value ``v``, ``v`` itself left out."""
    out = []
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        out.append(prefix + (k,))
        out += node_paths(x, prefix + (k,))
    return out


def set_path(body: dict, path: tuple, value) -> None:
    """Set the member at ``path`` (``("input", 0, "content")``) of ``body``, in place."""
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


# -- routes --------------------------------------------------------------------------------

LLAMA_GEN = ["/completion", "/completions"]
CHAT = ["/v1/chat/completions", "/chat/completions"]
OAI_COMPLETION = ["/v1/completions"]
EMBEDDINGS = ["/embedding", "/embeddings", "/v1/embeddings"]
GET_ROUTES = ["/health", "/v1/health", "/models", "/v1/models", "/props", "/slots", "/metrics"]
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
#: GET routes whose ``{id}`` is a stored response's (:data:`REAL_ID`) or junk
RESPONSE_ID_ROUTES = ["/v1/responses/{id}", "/v1/responses/{id}/input_items"]
#: route -> weight (most cases go to the routes that generate)
POST_ROUTES = {"/completion": 6, "/completions": 2, "/v1/chat/completions": 6, "/chat/completions": 2,
               "/v1/completions": 4, "/tokenize": 3, "/detokenize": 2, "/apply-template": 3, "/infill": 1,
               "/embedding": 1, "/embeddings": 1, "/v1/embeddings": 1, "/rerank": 1, "/props": 1,
               "/slots/{id}": 3, RESPONSES: 4, MESSAGES: 4, COUNT_TOKENS: 1}
#: the generating route -> its length field
LENGTH_FIELD = {**{r: "n_predict" for r in LLAMA_GEN + ["/infill"]}, **{r: "max_tokens" for r in CHAT},
                **{r: "max_tokens" for r in OAI_COMPLETION}, RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}
#: Accept headers for GET / and the page each must get: "html", "plain", or None (either)
ACCEPTS = [({"Accept": "text/html"}, "html"), ({"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}, "html"),
           ({"Accept": "*/*"}, "plain"), ({}, "plain"), ({"Accept": "application/json"}, "plain"),
           ({"Accept": "text/html;q=0"}, "plain"), ({"Accept": "text/html;q=abc"}, None),
           ({"Accept": "TEXT/HTML; Q=0.5"}, None), ({"Accept": "text/plain; q=0.9, text/html"}, "html"),
           ({"Accept": "text/html;q=1e400"}, None), ({"Accept": ",;=;,"}, "plain")]


def dialect(route: str) -> str:
    """Which dialect answers ``route``: "anthropic" (/v1/messages...), "responses"
    (/v1/responses...), "webui" (GET /) or "openai" (every other: llama-server's and OpenAI's
    envelope)."""
    if route == MESSAGES or route.startswith(MESSAGES + "/"):
        return "anthropic"
    if route == RESPONSES or route.startswith(RESPONSES + "/"):
        return "responses"
    return "webui" if route == "/" else "openai"
SLOT_IDS = ["0", "1", "2", "-1", "00", "+1", " 1", "١", "1.0", "abc", "", "9" * 30, "0x1", "\ud800"]
SLOT_ACTIONS = ["save", "restore", "erase", "", "SAVE", "bogus", "save&action=erase", "\ud800"]
FILENAMES = ["fuzz.bin", "", ".", "..", "../x", "/etc/passwd", "a/b", "a\\b", "\ud800", "x" * 300, "\x00",
             "fuzz\ud800.bin", "CON", "fuzz two.bin", "-", ".hidden"]


def prompt_values():
    return st.one_of(short_text, texts, st.lists(st.integers(0, 300), max_size=6),
                     st.lists(st.one_of(short_text, st.integers(0, 300)), min_size=1, max_size=3))


def base_body(route: str, draw) -> dict:
    """A plausible valid body for ``route`` with a few optional fields."""
    if route in LLAMA_GEN:
        body = {"prompt": draw(prompt_values()), "n_predict": draw(st.integers(0, MAX_GEN))}
        optional = SAMPLING_FIELDS
    elif route in CHAT:
        body = {"messages": draw(messages()), "max_tokens": draw(st.integers(1, MAX_GEN))}
        optional = SAMPLING_FIELDS + ["logprobs", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs"]
    elif route in OAI_COMPLETION:
        body = {"prompt": draw(prompt_values()), "max_tokens": draw(st.integers(1, MAX_GEN))}
        optional = SAMPLING_FIELDS
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 3))
    elif route == "/tokenize":
        body = {"content": draw(st.one_of(short_text, texts))}
        optional = ["add_special", "parse_special", "with_pieces"]
        for f in optional:
            if draw(st.booleans()):
                body[f] = draw(st.booleans())
        return body
    elif route == "/detokenize":
        return {"tokens": draw(st.lists(st.integers(0, 300), max_size=8))}
    elif route == "/apply-template":
        body = {"messages": draw(messages())}
        optional = ["tools", "chat_template_kwargs"]
    elif route == "/infill":
        return {"input_prefix": draw(short_text), "input_suffix": draw(short_text), "n_predict": 2}
    elif route in EMBEDDINGS:
        return {"content": draw(short_text), "input": draw(short_text)}
    elif route == "/rerank":
        return {"query": draw(short_text), "documents": draw(st.lists(short_text, max_size=3))}
    elif route == "/slots/{id}":
        return {"filename": draw(st.sampled_from(FILENAMES[:1] + ["fuzz-2.bin"]))}
    elif route == RESPONSES:
        return responses_body(draw)
    elif route in (MESSAGES, COUNT_TOKENS):
        return anthropic_body(route, draw)
    else:  # POST /props
        return {}
    for f in draw(st.lists(st.sampled_from([f for f in optional if f in PLAUSIBLE]), max_size=3, unique=True)):
        body[f] = draw(PLAUSIBLE[f])
    return body


def is_generation(route: str) -> bool:
    return route in LENGTH_FIELD


def force_small(route: str, body, targeted: str | None) -> None:
    """Keep generation at <= MAX_GEN tokens unless the mutation targets the length field
    (``max_output_tokens`` on /v1/responses, ``max_tokens`` on /v1/messages)."""
    if not isinstance(body, dict) or not is_generation(route) or targeted in LENGTH_FIELDS + list(LENGTH_FIELD.values()):
        return
    if route in (RESPONSES, MESSAGES):
        body[LENGTH_FIELD[route]] = MAX_GEN
        return
    for f in LENGTH_FIELDS:
        body.pop(f, None)
    body[LENGTH_FIELD[route]] = MAX_GEN


@st.composite
def mutated_body(draw, route: str):
    """A valid body with one to three fields (or its messages) set to hostile values; on the
    Responses and Messages routes also one member at any depth, or odd items / turns."""
    body = base_body(route, draw)
    kinds = ["field", "field", "field", "unknown", "delete", "message"]
    fragile, plausible = FRAGILE_FIELDS, PLAUSIBLE
    if route == RESPONSES or route in (MESSAGES, COUNT_TOKENS):
        kinds += ["nested", "nested"]
        fragile = RESPONSES_FIELDS if route == RESPONSES else ANTHROPIC_FIELDS
        plausible = {**PLAUSIBLE, **(RESPONSES_PLAUSIBLE if route == RESPONSES else ANTHROPIC_PLAUSIBLE)}
    where = draw(st.sampled_from(kinds))
    targeted = None
    if where == "message" and route == RESPONSES:
        body["input"] = draw(response_items(odd=True))
    elif where == "message" and route in (MESSAGES, COUNT_TOKENS):
        body["messages"] = draw(anthropic_messages(odd=True))
    elif where == "nested" and node_paths(body):  # one member deep inside (an item's, a tool's, a block's)
        body = copy.deepcopy(body)  # its members may be the module's constants (TOOLS...): never change those
        path = draw(st.sampled_from(node_paths(body)))
        name = next((k for k in reversed(path) if isinstance(k, str)), "")
        set_path(body, path, draw(st.one_of(hostile_for(name), hostile_for(name), deep_values)))
        targeted = path[0] if len(path) == 1 else None
    elif where == "message" and isinstance(body.get("messages"), list):
        body["messages"] = draw(messages(odd=True))
    elif where == "delete" and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif where == "unknown":
        body[draw(st.one_of(st.sampled_from(UNKNOWN_FIELDS), texts))] = draw(hostile)
    else:  # one to three fields, mostly where the bugs of issue #11 were
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.one_of(st.sampled_from(fragile), st.sampled_from(ALL_FIELDS + list(body))))
            body[name] = draw(st.one_of(hostile_for(name), hostile_for(name), plausible.get(name, hostile)))
            targeted = name if name in LENGTH_FIELDS or name == LENGTH_FIELD.get(route) else targeted
    force_small(route, body, targeted)
    return body


@st.composite
def garbage(draw, route: str) -> bytes:
    """Bytes that are not one JSON object."""
    valid = encode(base_body(route, draw)).encode()
    fixed = st.sampled_from([
        b"", b"   ", b"\n", b"null", b"[]", b"1", b'"s"', b"true", b"[{}]", b"{", b"}", b"{]",
        b'{"prompt": "a",}', b"{'prompt': 'a'}", b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}',
        b"\xef\xbb\xbf" + valid, valid + b"x", valid + valid, valid[: max(1, len(valid) // 2)],
        b'{"a": 1, "a": 2}', b'{"prompt": "a" /* c */}', b"\x00" * 8, b'{"\\ud800": 1}',
        b'{"prompt": "\\u12"}', b'{"prompt": "\\x41"}', b'{"n_predict": 01}', b'{"n_predict": .5}',
        b'{"n_predict": 1.}', b'{"n_predict": +1}', b'{"n_predict": 0x10}', b'{"prompt": "' + b"\\" * 3 + b'"}',
    ])
    return draw(st.one_of(fixed, fixed, fixed, st.binary(max_size=48)))


@st.composite
def body_for(draw, route: str) -> tuple[bytes, object]:
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "random", "garbage"]))
    if kind == "garbage":
        return draw(garbage(route)), None
    if kind == "valid":
        value = base_body(route, draw)
        force_small(route, value, None)
    elif kind == "mutated":
        value = draw(mutated_body(route))
    else:
        value = draw(st.dictionaries(st.one_of(st.sampled_from(ALL_FIELDS), texts), json_values(), max_size=6))
        force_small(route, value, None)
    return encode(value).encode(), value


def _q(s: str) -> str:
    return quote(s.encode("utf-8", "surrogatepass"), safe="=&?%")


CONTENT_TYPES = [{"Content-Type": "application/json"}] * 6 + [
    {}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "application/json; charset=latin-1"}, {"Content-Type": "multipart/form-data"}]
QUERIES = ["", "", "", "?fail_on_no_slot=1", "?model=x", "?\ud800=1", "?a=" + "b" * 2000, "?%zz", "?&&="]
ITEMS_QUERIES = ["", "?order=asc", "?order=desc&limit=1", "?limit=0", "?limit=101", "?limit=-1", "?limit=1e3",
                 "?limit=" + "9" * 5000, "?limit=\u00b2", "?after=msg_x", "?after=\ud800", "?order=\ud800", "?limit=\u0661",
                 "?limit=1&after=" + REAL_ID]


@st.composite
def cases(draw) -> Case:
    """One request to any route, weighted towards the routes that generate."""
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "DELETE"]))
        route = draw(st.sampled_from(GET_ROUTES + ["/slots", "/slots", "/nope", "/v1/nope", "/completion",
                                                   "/slots/0", "/", "/", *RESPONSE_ID_ROUTES, *RESPONSE_ID_ROUTES,
                                                   RESPONSES, MESSAGES, MESSAGES + "/batches", COUNT_TOKENS]))
        headers = {}
        if route == "/":
            headers = dict(draw(st.sampled_from(ACCEPTS))[0])
        if route in RESPONSE_ID_ROUTES:
            rid = draw(st.one_of(st.just(REAL_ID), st.just(REAL_ID), st.sampled_from(JUNK_IDS)))
            path = route.replace("{id}", _q(rid) if rid != REAL_ID else rid)
            if route.endswith("/input_items"):
                path += _q(draw(st.sampled_from(ITEMS_QUERIES)))
        else:
            path = route + _q(draw(st.sampled_from(QUERIES)))
        return Case(method, route, path, headers=headers)
    routes = [r for r, w in POST_ROUTES.items() for _ in range(w)]
    route = draw(st.sampled_from(routes))
    body, value = draw(body_for(route))
    path = route
    if route == "/slots/{id}":  # mostly a real slot and action, so that the file name is reached
        sid = draw(st.one_of(st.sampled_from(["0", "1"]), st.sampled_from(SLOT_IDS)))
        action = draw(st.one_of(st.sampled_from(SLOT_ACTIONS[:3]), st.sampled_from(SLOT_ACTIONS)))
        path = f"/slots/{_q(sid)}?action={_q(action)}"
        if isinstance(value, dict) and "filename" in value and draw(st.booleans()):
            value["filename"] = draw(st.one_of(st.sampled_from(FILENAMES), texts))
            body = encode(value).encode()
    return Case("POST", route, path, body, dict(draw(st.sampled_from(CONTENT_TYPES))), value)


# -- a fixed matrix: every fragile field x its worst values ----------------------------------

WORST_NUMBERS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("1" + "0" * 400),
                 Raw("9" * 5000), "1", True, None, []]
WORST_STRINGS = ["\ud800", "a\udfffb", 7, None, [], {"a": 1}]
WORST_OTHER = ["\ud800", Raw("NaN"), Raw("9" * 5000), {}, [None], "x", deep(5000)]
MATRIX_ROUTES = {"/completion": {"prompt": "Hi", "n_predict": MAX_GEN},
                 "/v1/completions": {"prompt": "Hi", "max_tokens": MAX_GEN},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_GEN}}


#: the Responses and Messages rows' worst values (fewer than above: there are many more fields)
#: (None on a length field is no limit: a long answer, so the length fields go without it)
WORST_NUMBERS_2 = [Raw("NaN"), Raw("1e400"), Raw("9" * 5000), "1", True, -1, 2**63, None]
WORST_STRINGS_2 = ["\ud800", 7, None, [], {"a": 1}]
WORST_OTHER_2 = ["\ud800", Raw("NaN"), {}, [None], "x", deep(5000)]
#: each member of a rich body gets this many of its kind's worst values (in turn, so that
#: every value meets some member)
NESTED_WORST = 3
#: a Responses body that reaches every part of the translation (instructions, each item type,
#: a function tool, tool_choice, text.format, reasoning, metadata)
RESPONSES_RICH = {
    "instructions": "Be brief.",
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
              {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call the tool."}]},
              {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
              {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
    "tools": [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER_SCHEMA,
               "strict": True}],
    "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]},
    "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "verbosity": "low"},
    "reasoning": {"effort": "low", "summary": "auto"},
    "metadata": {"k": "v"}, "max_output_tokens": MAX_GEN, "temperature": 0}
#: the same for the Messages API (system blocks, tool_use and tool_result, a tool, tool_choice,
#: stop_sequences, thinking with a budget, output_config)
ANTHROPIC_RICH = {
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                                                   {"type": "text", "text": "Checking."},
                                                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {"city": "Paris"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": [{"type": "text", "text": "sunny"}]},
                                              {"type": "text", "text": "And?"}]}],
    "tools": [{"name": "get_weather", "description": "weather", "input_schema": WEATHER_SCHEMA}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\n"], "thinking": {"type": "enabled", "budget_tokens": 2},
    "output_config": {"effort": "low"}, "max_tokens": MAX_GEN, "temperature": 0}
#: route -> (plain base, top-level fields, rich base, its member paths): each x its worst values
#: (of kvserve's extensions only temperature/top_p/top_k: the rest go the chat rows' way)
DIALECT_MATRIX = {
    RESPONSES: ({"input": "Hi", "max_output_tokens": MAX_GEN}, RESPONSES_FIELDS[:16] + ["temperature", "top_p"],
                RESPONSES_RICH,
                ["input.0.content", "input.0.content.0.text", "input.0.content.0.type", "input.0.role",
                 "input.0.type", "input.1.summary", "input.1.summary.0.text", "input.2.call_id", "input.2.name",
                 "input.2.arguments", "input.3.call_id", "input.3.output", "tools.0.type", "tools.0.name",
                 "tools.0.parameters", "tools.0.strict", "tool_choice.type", "tool_choice.mode", "tool_choice.tools",
                 "tool_choice.tools.0.name", "text.format",
                 "text.format.type", "text.format.name", "text.format.schema", "text.format.strict",
                 "text.verbosity", "reasoning.effort", "reasoning.summary", "metadata.k"]),
    MESSAGES: ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_GEN}, ANTHROPIC_FIELDS[:13],
               ANTHROPIC_RICH,
               ["system.0.text", "system.0.type", "messages.0.role", "messages.0.content",
                "messages.1.content.1.text", "messages.1.content.2.id", "messages.1.content.2.name",
                "messages.1.content.2.input", "messages.1.content.0.type", "messages.2.content.0.tool_use_id",
                "messages.2.content.0.content", "messages.2.content.0.type", "tools.0.name", "tools.0.input_schema",
                "tools.0.type", "tools.0.description", "tool_choice.type", "tool_choice.disable_parallel_tool_use", "stop_sequences.0", "thinking.type",
                "thinking.budget_tokens", "output_config.effort"]),
    COUNT_TOKENS: ({"messages": [{"role": "user", "content": "Hi"}]}, ["messages", "system", "tools", "tool_choice",
                                                                       "thinking"],
                   {k: v for k, v in ANTHROPIC_RICH.items() if k not in ("max_tokens", "temperature")},
                   ["messages.1.content.2.input", "messages.2.content.0.content", "tools.0.input_schema",
                    "thinking.budget_tokens"]),
}


def _path(dotted: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in dotted.split("."))


def dialect_matrix_cases() -> list[Case]:
    """Each of /v1/responses, /v1/messages, /v1/messages/count_tokens x each of its fields (on a
    plain body) and each member of its rich body x the worst values of its kind; every other
    row of the generating routes streams."""
    out = []
    for route, (plain, fields, rich, paths) in DIALECT_MATRIX.items():
        rows = [(plain, (f,)) for f in fields] + [(rich, _path(p)) for p in paths]
        for k, (base, path) in enumerate(rows):
            name = path[-1] if isinstance(path[-1], str) else path[-2]
            worst = WORST_NUMBERS_2 if name in NUMBER_FIELDS or name in INT_FIELDS else \
                WORST_STRINGS_2 if name in STRING_FIELDS else WORST_OTHER_2
            if name == LENGTH_FIELD.get(route):
                worst = worst[:-1]
            if len(path) > 1:
                worst = [worst[(k + j) % len(worst)] for j in range(NESTED_WORST)]
            for v in worst:
                body = copy.deepcopy(base)
                set_path(body, path, v)
                force_small(route, body, path[0] if len(path) == 1 else None)
                if route != COUNT_TOKENS and len(out) % 2 and path != ("stream",):
                    body["stream"] = True
                out.append(Case("POST", route, route, encode(body).encode(), {"Content-Type": "application/json"},
                                body))
    for rid in [REAL_ID, "resp_0", "\ud800"]:
        for route in RESPONSE_ID_ROUTES:
            out.append(Case("GET", route, route.replace("{id}", rid if rid == REAL_ID else _q(rid))))
    for q in ITEMS_QUERIES:
        out.append(Case("GET", RESPONSE_ID_ROUTES[1], RESPONSE_ID_ROUTES[1].replace("{id}", REAL_ID) + _q(q)))
    for headers, _ in ACCEPTS:
        out.append(Case("GET", "/", "/", headers=dict(headers)))
    return out


def matrix_cases() -> list[Case]:
    """Each generation dialect x each fragile field x the worst values of its kind, then the
    chat_template_kwargs keys the renderer passes itself and slot file names with surrogates
    (the causes of issue #11, so that every run tries each one at least once)."""
    out = []
    for route, base in MATRIX_ROUTES.items():
        for name in FRAGILE_FIELDS + ["n_predict", "max_tokens"]:
            worst = WORST_NUMBERS if name in NUMBER_FIELDS or name in INT_FIELDS else \
                WORST_STRINGS if name in STRING_FIELDS else WORST_OTHER
            for v in worst:
                body = {**base, name: v}
                force_small(route, body, name)
                out.append(Case("POST", route, route, encode(body).encode(), {"Content-Type": "application/json"},
                                body))
    for route in ["/v1/chat/completions", "/apply-template"]:
        for key in ["tools", "messages", "add_generation_prompt", "continue_final_message", "bos_token"]:
            body = {**MATRIX_ROUTES["/v1/chat/completions"], "chat_template_kwargs": {key: []}}
            out.append(Case("POST", route, route, encode(body).encode(), {}, body))
    for name in ["\ud800", "a\udfff.bin", "fuzz.bin"]:
        for action in ["save", "restore"]:
            body = {"filename": name}
            out.append(Case("POST", "/slots/{id}", f"/slots/0?action={action}", encode(body).encode(), {}, body))
    return out + dialect_matrix_cases()
