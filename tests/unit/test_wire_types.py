"""The faces' wire types (kvserve.faces.openai_types, kvserve.faces.llama_types).

Round trips of literal JSON: real llama-server outputs from seed 000 (Examples 2, 4, 5, 6, 7, 11,
13) and kvserve's own output where the seed has none (logprobs, reasoning, props); key order is
checked at every level (``list(d)`` and the JSON text). Then the faces themselves, driven with
canned engine outputs, must write exactly what they wrote before they were built on these types.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

import pytest
from pydantic import TypeAdapter, ValidationError

import kvserve.faces.llama_api as llama_face
import kvserve.faces.openai as openai_face
import kvserve.serving.choices as choices
from kvserve.engine.request import (
    RequestOutput,
    SamplingParams,
    Timings,
    TokenLogprob,
    TopLogprob,
)
from kvserve.faces import llama_types as lt
from kvserve.faces import openai_types as ot
from kvserve.faces.params import params_to_dict


def _same(out, literal) -> None:
    """Equal values and equal key order at every level (the JSON texts are equal), ints not floats."""
    assert out == literal
    if isinstance(literal, dict):
        assert list(out) == list(literal)
    assert json.dumps(out) == json.dumps(literal)


def roundtrip(model, text: str) -> dict:
    """Validate literal JSON into ``model``, write it back with ``.wire()``: it must be the same."""
    literal = json.loads(text)
    _same(model.model_validate(literal).wire(), literal)
    return literal


def roundtrip_leaf(leaf, text: str) -> None:
    """The same for a TypedDict leaf (validated and written by pydantic through a TypeAdapter)."""
    literal = json.loads(text)
    ta = TypeAdapter(leaf)
    _same(ta.dump_python(ta.validate_python(literal)), literal)


TIMINGS_EX4 = ('{"cache_n": 0, "prompt_n": 25, "prompt_ms": 12.4, "prompt_per_token_ms": 0.496,'
               ' "prompt_per_second": 2016.1290322580644, "predicted_n": 8, "predicted_ms": 63.761,'
               ' "predicted_per_token_ms": 9.108714285714287, "predicted_per_second": 109.78497827825785}')


# -- seed 000: the OpenAI face --------------------------------------------------------------

def test_chat_completion_seed_example_4():
    d = roundtrip(ot.ChatCompletion, """{
        "choices": [{"finish_reason": "length", "index": 0, "message": {"role": "assistant",
            "content": "\\u05ea\\u05d7\\u05e8ContentAlignmentContentAlignment"}}],
        "created": 1791032120, "model": "tiny-coder", "system_fingerprint": "b1-0c1e570",
        "object": "chat.completion",
        "usage": {"completion_tokens": 8, "prompt_tokens": 25, "total_tokens": 33,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "id": "chatcmpl-v8pXBvqeSgK7ciB8dTvN4RxrS4egYISr",
        "timings": TIMINGS}""".replace("TIMINGS", TIMINGS_EX4))
    assert list(d) == ["choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings"]
    roundtrip(lt.Timings, TIMINGS_EX4)


SEED_EX5_CHUNKS = [
    ('{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1791032124,'
     '"id":"chatcmpl-EUFvYdRRUXr7E3EXLMXfh9eIZpLzWZAs","model":"tiny-coder","system_fingerprint":"b1-0c1e570",'
     '"object":"chat.completion.chunk"}'),
    ('{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\ud83c\\uddf7"}}],"created":1791032124,'
     '"id":"chatcmpl-EUFvYdRRUXr7E3EXLMXfh9eIZpLzWZAs","model":"tiny-coder","system_fingerprint":"b1-0c1e570",'
     '"object":"chat.completion.chunk"}'),
    ('{"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1791032124,'
     '"id":"chatcmpl-EUFvYdRRUXr7E3EXLMXfh9eIZpLzWZAs","model":"tiny-coder","system_fingerprint":"b1-0c1e570",'
     '"object":"chat.completion.chunk","timings":{"cache_n":6,"prompt_n":15,"prompt_ms":10.74,'
     '"prompt_per_token_ms":0.716,"prompt_per_second":1396.6480446927374,"predicted_n":4,"predicted_ms":26.159,'
     '"predicted_per_token_ms":8.719666666666667,"predicted_per_second":114.68328300011468}}'),
    ('{"choices":[],"created":1791032124,"id":"chatcmpl-GlZFInhbPqXB5KsXxl4VhqI9hItTOVDD","model":"tiny-coder",'
     '"system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk","usage":{"completion_tokens":3,'
     '"prompt_tokens":21,"total_tokens":24,"prompt_tokens_details":{"cached_tokens":20}},"timings":{"cache_n":20,'
     '"prompt_n":1,"prompt_ms":7.805,"prompt_per_token_ms":7.805,"prompt_per_second":128.12299807815504,'
     '"predicted_n":3,"predicted_ms":14.001,"predicted_per_token_ms":7.0005,"predicted_per_second":142.8469395043211}}'),
]


@pytest.mark.parametrize("text", SEED_EX5_CHUNKS, ids=["role", "content", "finish", "usage"])
def test_chat_chunks_seed_example_5(text):
    roundtrip(ot.ChatCompletionChunk, text)


def test_tool_calls_seed_example_13():
    roundtrip(ot.ToolCall, '{"type": "function", "function": {"name": "read_file", "arguments":'
                           ' "{\\"path\\":\\"src/Main.java\\" }"}, "id": "M3mfl7vHzOC3GP1WmM9kVxUEbFGmQv23"}')
    roundtrip(ot.ChatDelta, '{"tool_calls":[{"index":0,"id":"5ztHnIb8odTda96BAIowHvag0ZjNWH7b","type":"function",'
                            '"function":{"name":"read_file","arguments":"{"}}]}')
    roundtrip(ot.ChatDelta, '{"tool_calls":[{"index":0,"function":{"arguments":"path"}}]}')
    roundtrip(ot.ChatChunkChoice, '{"finish_reason":"tool_calls","index":0,"delta":{}}')


# -- seed 000: the llama-server face --------------------------------------------------------

def test_completion_result_seed_example_6():
    d = roundtrip(lt.CompletionResult, """{
        "index": 0, "content": "\\u6642\\u9593\\u6642\\u9593\\u6642\\u9593\\u5e7f\\u6cdb", "tokens": [],
        "id_slot": 0, "stop": true, "model": "tiny-coder", "tokens_predicted": 4, "tokens_evaluated": 4,
        "generation_settings": {"temperature": 0.0, "top_k": 40, "max_tokens": 4, "n_predict": 4,
                                "grammar": "", "chat_format": "Content-only"},
        "prompt": "public static void main", "has_new_line": false, "truncated": false,
        "stop_type": "limit", "stopping_word": "", "tokens_cached": 7,
        "timings": {"cache_n": 0, "prompt_n": 4, "prompt_ms": 10.907, "prompt_per_token_ms": 2.72675,
                    "prompt_per_second": 366.7369579169341, "predicted_n": 4, "predicted_ms": 21.38,
                    "predicted_per_token_ms": 7.126666666666666, "predicted_per_second": 140.31805425631433}}""")
    assert list(d)[:5] == ["index", "content", "tokens", "id_slot", "stop"]


def test_tokenize_detokenize_apply_template_seed_example_7():
    roundtrip(lt.TokenizeResponse, '{"tokens":[888,1099,737,1887]}')
    roundtrip(lt.TokenizePiecesResponse, '{"tokens":[{"id":888,"piece":"public"},{"id":1099,"piece":" static"}]}')
    roundtrip(lt.TokenizePiecesResponse, '{"tokens":[{"id":151644,"piece":"<|im_start|>"},{"id":872,"piece":"user"}]}')
    roundtrip(lt.TokenizePiecesResponse, '{"tokens":[{"id":5,"piece":[226,150]}]}')  # not UTF-8 alone: bytes
    roundtrip(lt.DetokenizeResponse, '{"content":"public static void main"}')
    roundtrip(lt.ApplyTemplateResponse, '{"prompt":"<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n'
                                        '<|im_start|>user\\nSay hi.<|im_end|>\\n<|im_start|>assistant\\n"}')


def test_health_and_slot_files_seed_examples_2_and_11():
    roundtrip(lt.HealthResponse, '{"status":"ok"}')
    roundtrip(lt.PropsUpdateResponse, '{"success":true}')
    roundtrip(lt.SlotSaveResponse, '{"id_slot":0,"filename":"review-prefix2.bin","n_saved":28,"n_written":29264,'
                                   '"timings":{"save_ms":0.12}}')
    roundtrip(lt.SlotEraseResponse, '{"id_slot":0,"n_erased":28}')
    roundtrip(lt.SlotRestoreResponse, '{"id_slot":0,"filename":"review-prefix2.bin","n_restored":28,'
                                      '"n_read":29264,"timings":{"restore_ms":0.147}}')


# -- kvserve's own output (no seed shows these) ---------------------------------------------

TIMINGS_6_2 = ('{"cache_n": 2, "prompt_n": 6, "prompt_ms": 10.5, "prompt_per_token_ms": 1.75,'
               ' "prompt_per_second": 571.4285714285714, "predicted_n": 2, "predicted_ms": 21.0,'
               ' "predicted_per_token_ms": 21.0, "predicted_per_second": 47.61904761904762}')

TEXT_ECHO_LOGPROBS = """{"choices": [{"finish_reason": "length", "index": 0, "text": "Hello! ok", "logprobs": {
    "tokens": ["He", "llo", "\\ufffd", "!", " ok"], "token_logprobs": [null, -1.25, -9999.0, -0.5, -1.0],
    "top_logprobs": [null, {"llo": -1.25, "p": -2.0}, {}, {"!": -0.5, "yy": -3.0}, {" ok": -1.0, "yy": -3.0}],
    "text_offset": [0, 2, 5, 6, 7]}}], "created": 1791032120, "model": "tiny", "system_fingerprint": "b1-test",
    "object": "text_completion", "usage": {"completion_tokens": 2, "prompt_tokens": 6, "total_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 2}}, "id": "cmpl-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
    "timings": TIMINGS}""".replace("TIMINGS", TIMINGS_6_2)

CHAT_LOGPROBS_CHUNK = """{"choices": [{"finish_reason": null, "index": 0, "delta": {"content": "Hi"},
    "logprobs": {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "yy", "logprob": -3.0, "bytes": [121, 121]}]}]}}],
    "created": 1791032120, "id": "chatcmpl-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "model": "tiny",
    "system_fingerprint": "b1-test", "object": "chat.completion.chunk"}"""

CHAT_REASONING = """{"choices": [{"finish_reason": "stop", "index": 0, "message": {"role": "assistant",
    "reasoning_content": "hmm", "content": "Answer"}}], "created": 1791032120, "model": "tiny",
    "system_fingerprint": "b1-test", "object": "chat.completion", "usage": {"completion_tokens": 4,
    "prompt_tokens": 6, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2},
    "completion_tokens_details": {"reasoning_tokens": 3}}, "id": "chatcmpl-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
    "timings": TIMINGS}""".replace("TIMINGS", TIMINGS_6_2)

PROBS_ENTRY = ('{"id": 10, "token": "Hel", "bytes": [72, 101, 108], "logprob": -0.5, "top_logprobs": ['
               '{"id": 10, "token": "Hel", "bytes": [72, 101, 108], "logprob": -0.5},'
               ' {"id": 99, "token": "zz", "bytes": [122, 122], "logprob": -9999.0}]}')
POST_PROBS_ENTRY = ('{"id": 10, "token": "Hel", "bytes": [72, 101, 108], "prob": 0.6065306597126334, "top_probs": ['
                    '{"id": 10, "token": "Hel", "bytes": [72, 101, 108], "prob": 0.6065306597126334},'
                    ' {"id": 99, "token": "zz", "bytes": [122, 122], "prob": 0.0}]}')


def test_legacy_completion_with_echo_logprobs():
    roundtrip(ot.TextCompletion, TEXT_ECHO_LOGPROBS)
    roundtrip(ot.TextCompletionChunk, """{"choices": [{"finish_reason": "length", "index": 0, "text": "",
        "logprobs": null}], "created": 1791032120, "id": "cmpl-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "model": "tiny",
        "system_fingerprint": "b1-test", "object": "text_completion", "timings": TIMINGS}""".replace("TIMINGS", TIMINGS_6_2))


def test_chat_logprobs_reasoning_and_usage_details():
    roundtrip(ot.ChatCompletionChunk, CHAT_LOGPROBS_CHUNK)
    roundtrip(ot.ChatCompletion, CHAT_REASONING)
    roundtrip(ot.ChatMessage, '{"role": "assistant", "reasoning": "hmm", "content": "Answer"}')  # vLLM's field
    roundtrip(ot.ChatMessage, '{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",'
                              ' "arguments": "{\\"x\\": 1}"}, "id": "call_1"}], "content": "Sure."}')
    roundtrip(ot.ChatDelta, '{"reasoning_content": " creek"}')
    roundtrip_leaf(ot.ChatTopLogprob, '{"token": "yy", "logprob": -3.0, "bytes": [121, 121]}')


def test_completion_probabilities_and_stream_chunks():
    roundtrip_leaf(lt.TokenLogprobs, PROBS_ENTRY)
    roundtrip_leaf(lt.TokenProbs, POST_PROBS_ENTRY)
    roundtrip_leaf(lt.TopProb, '{"id": 99, "token": "zz", "bytes": [122, 122], "prob": 0.0}')
    head = ('{"index": 0, "content": "Hel", "tokens": [10], "stop": false, "id_slot": 0, "stop_type": "none",'
            ' "tokens_predicted": 1, "tokens_evaluated": 6')
    roundtrip(lt.CompletionChunk, head + "}")
    roundtrip(lt.CompletionChunk, head + ', "completion_probabilities": [' + PROBS_ENTRY + "]}")
    roundtrip(lt.CompletionChunk, head + ', "completion_probabilities": [' + POST_PROBS_ENTRY + "]}")


def test_props_and_cache_miss_timings():
    d = roundtrip(lt.Props, """{"default_generation_settings": {"params": {"n_predict": -1, "seed": 4294967295},
        "n_ctx": 2048}, "total_slots": 2, "model_alias": "tiny", "model_path": "/m.gguf",
        "modalities": {"vision": false, "video": false, "audio": false}, "endpoint_slots": true,
        "endpoint_props": false, "endpoint_metrics": true, "ui": true, "ui_settings": {}, "webui": true,
        "webui_settings": {}, "chat_template": "",
        "chat_template_caps": {"supports_tools": false}, "bos_token": "<s>", "eos_token": "</s>",
        "build_info": "b1-test", "is_sleeping": false, "cors_proxy_enabled": false}""")
    assert list(d)[-4:] == ["eos_token", "build_info", "is_sleeping", "cors_proxy_enabled"]
    roundtrip(lt.Timings, TIMINGS_6_2[:-1] + ', "cache_miss": {"reason": "evicted", "n": 3}}')


# -- which keys are written -------------------------------------------------------------------

def test_absent_and_null():
    assert ot.ChatDelta().wire() == {}
    assert list(ot.ChatDelta(role="assistant", content=None).wire()) == ["role", "content"]
    c = ot.ChatChunkChoice(finish_reason=None, index=0, delta=ot.ChatDelta(content="x"))
    assert c.wire() == {"finish_reason": None, "index": 0, "delta": {"content": "x"}}
    c.logprobs = ot.ChatLogprobs(content=[])  # assigned: written
    assert list(c.wire()) == ["finish_reason", "index", "delta", "logprobs"]
    assert ot.TextChoice(finish_reason=None, index=0, text="", logprobs=None).wire()["logprobs"] is None
    t = lt.Timings.of(Timings(prompt_n=4, predicted_n=1))
    assert "cache_miss" not in t.wire() and t.wire() == Timings(prompt_n=4, predicted_n=1).to_dict()


def test_timings_rates_count_decode_steps_as_llama_server():
    """llama-server's server_slot_stats: the first token is free (it comes from the prompt's
    logits), so rates count predicted_n - 1 steps; a rate whose divisor is 0 is 0.0."""
    one = Timings(prompt_n=4, prompt_ms=8.0, predicted_n=1, predicted_ms=0.001).to_dict()
    assert (one["predicted_per_token_ms"], one["predicted_per_second"]) == (0.0, 0.0)
    assert (one["prompt_per_token_ms"], one["prompt_per_second"]) == (2.0, 500.0)
    sixteen = Timings(prompt_n=2, prompt_ms=4.0, predicted_n=16, predicted_ms=30.0).to_dict()
    assert (sixteen["predicted_per_token_ms"], sixteen["predicted_per_second"]) == (2.0, 500.0)
    none = Timings(cache_n=3).to_dict()
    assert [none[k] for k in ("prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms",
                              "predicted_per_second")] == [0.0, 0.0, 0.0, 0.0]


def test_refuses_unknown_keys_wrong_types_and_missing_fields():
    with pytest.raises(ValidationError):
        ot.ChatDelta(contents="typo")
    with pytest.raises(ValidationError):
        lt.TokenizeResponse(tokens=[1.0])  # strict: no float -> int
    with pytest.raises(ValidationError):
        ot.Usage(completion_tokens=1, prompt_tokens=2, total_tokens=3)  # prompt_tokens_details is required
    with pytest.raises(ValidationError):
        lt.CompletionChunk.model_validate(json.loads(
            '{"index": 0, "content": "", "tokens": [], "stop": false, "id_slot": 0, "stop_type": "none",'
            ' "tokens_predicted": 1, "tokens_evaluated": 6, "completion_probabilities": [{"id": 1}]}'))
    assert lt.Timings(**{**json.loads(TIMINGS_6_2), "prompt_ms": 10}).prompt_ms.__class__ is float


# -- the faces build through the types: exactly what they wrote before -------------------------

def _lp(i: int, tok: str, logprob: float, tops) -> TokenLogprob:
    return TokenLogprob(i, tok, list(tok.encode()), logprob, [TopLogprob(j, t, list(t.encode()), v) for j, t, v in tops])


def _outputs(rid: str, pieces: list[str], *, with_lp: bool = False, stop: str = "limit", prompt_lp=None):
    """Canned engine outputs: one per piece, the last finished; 6 prompt tokens, 2 of them cached."""
    outs = []
    for k, p in enumerate(pieces):
        fin = k == len(pieces) - 1
        o = RequestOutput(rid, [10 + k], p, finished=fin, stop_type=stop if fin else "none", num_prompt_tokens=6,
                          num_cached_tokens=2, num_output_tokens=k + 1,
                          timings=Timings(cache_n=2, prompt_n=6, prompt_ms=10.5, predicted_n=k + 1, predicted_ms=21.0))
        if with_lp:
            v = -0.5 * (k + 1)
            o.logprobs = [_lp(10 + k, p or "x", v, [(10 + k, p or "x", v), (99, "zz", -float("inf")), (98, "yy", -3.0)])]
        if k == 0:
            o.prompt_logprobs = prompt_lp
        outs.append(o)
    return outs


class _Tok:
    def token_bytes(self, t, special=False):
        return {1: b"He", 2: b"llo"}.get(t, b"?")


_STATE = NS(build_info="b1-test", tokenizer=_Tok(), model_alias="tiny")


def _plan(kind: str, **kw) -> openai_face.Plan:
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + "X" * 32
    return openai_face.Plan(kind, rid, 1791032120, "tiny", [NS(prompt_token_ids=[1, 2, 3])], **kw)


def _run(monkeypatch, outs):
    async def run_choices(state, plan, view=None, *, whole=False):
        for o in outs:
            yield 0, o

    monkeypatch.setattr(openai_face, "run_choices", run_choices)  # legacy completions
    monkeypatch.setattr(choices, "run_choices", run_choices)  # chat: through the serving layer's chat_events


async def _collect(agen) -> list:
    return [e async for e in agen]


def test_openai_face_chat_stream_with_logprobs(monkeypatch):
    _run(monkeypatch, _outputs("a", ["Hi", "", " you"], with_lp=True))
    events = asyncio.run(_collect(openai_face.stream_events(_STATE, _plan("chat", stream=True, logprobs=2))))
    assert len(events) == 4
    _same(events[0], json.loads(SEED_EX5_CHUNKS[0].replace("EUFvYdRRUXr7E3EXLMXfh9eIZpLzWZAs", "X" * 32)
                                .replace("1791032124", "1791032120").replace("tiny-coder", "tiny")
                                .replace("b1-0c1e570", "b1-test")))
    _same(events[1], json.loads(CHAT_LOGPROBS_CHUNK))
    assert [lp["token"] for lp in events[2]["choices"][0]["logprobs"]["content"]] == ["x", " you"]  # held with ""
    assert list(events[3]) == ["choices", "created", "id", "model", "system_fingerprint", "object", "timings"]
    assert events[3]["choices"] == [{"finish_reason": "length", "index": 0, "delta": {}}]


def test_openai_face_text_completion_with_echo(monkeypatch):
    prompt_lp = [None, _lp(2, "llo", -1.25, [(2, "llo", -1.25), (7, "p", -2.0)]), _lp(3, "\ufffd", -float("inf"), [])]
    _run(monkeypatch, _outputs("a", ["!", " ok"], with_lp=True, prompt_lp=prompt_lp))
    plan = _plan("text", logprobs=2, echo_texts=["Hello"])
    _same(asyncio.run(openai_face.complete(_STATE, plan)).wire(), json.loads(TEXT_ECHO_LOGPROBS))


def test_llama_face_completion_result_and_chunks():
    params = SamplingParams(n_probs=2, post_sampling_probs=True)
    handler = llama_face.CompletionHandler(NS(model_alias="tiny"))
    c = llama_face._Completion(0, "public static", [1, 2], NS(priority_slot=0))
    for o in _outputs("a", ["Hel"], with_lp=True, stop="word"):
        c.add(o, params.post_sampling_probs)
    opts = {"stream": False, "return_tokens": True, "grammar": ""}
    d = handler.final_json(c, params, opts, stream=False).wire()
    assert d.pop("generation_settings") == params_to_dict(params, grammar="")
    probs = json.loads(POST_PROBS_ENTRY)
    probs["top_probs"].append({"id": 98, "token": "yy", "bytes": [121, 121], "prob": 0.049787068367863944})
    _same(d, {"index": 0, "content": "Hel", "tokens": [10], "id_slot": 0, "stop": True, "model": "tiny",
              "tokens_predicted": 1, "tokens_evaluated": 6, "prompt": "public static", "has_new_line": False,
              "truncated": False, "stop_type": "word", "stopping_word": "", "tokens_cached": 6,
              "timings": {"cache_n": 2, "prompt_n": 6, "prompt_ms": 10.5, "prompt_per_token_ms": 1.75,
                          "prompt_per_second": 571.4285714285714, "predicted_n": 1, "predicted_ms": 21.0,
                          "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0},
              "completion_probabilities": [probs]})
    assert "completion_probabilities" not in handler.final_json(c, params, opts, stream=True).wire()
