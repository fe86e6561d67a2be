"""kvserve's typed chat request and its one planner (kvserve.serving.chat_plan.plan_chat),
in process on the tiny random GGUF (ChatML template): a request built without any face plans to
the same engine requests as the OpenAI face's body, dialect rules are fields of the request, and
the errors keep their texts."""

from __future__ import annotations

import pytest

from kvserve.engine.request import SEED_RANDOM, ContextSizeExceededError
from kvserve.errors import InvalidInputError
from kvserve.faces.api_error import ApiError
from kvserve.faces.openai import chat_plan, chat_request
from kvserve.serving.args import parse_args
from kvserve.serving.chat_plan import plan_chat
from kvserve.serving.chat_request import ChatRequest, ReasoningOptions, StreamOptions, TemplateOptions
from kvserve.serving.manager import ModelSpec
from kvserve.serving.chat_runner import load_runner

N_CTX = 256


@pytest.fixture(scope="module")
def runner(tiny_gguf):
    args = parse_args(["-m", tiny_gguf, "--device", "cpu", "--cache-ram", "0", "-c", str(N_CTX), "-np", "1"],
                      environ={})
    r = load_runner(args, ModelSpec("m", tiny_gguf), "test")
    yield r
    r.close()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_typed_request_plans_as_the_openai_body(runner):
    body = {"messages": _user("hi there"), "temperature": 0.5, "top_k": 7, "seed": 11, "n": 2,
            "max_tokens": 9, "stop": ["x"], "logprobs": True, "top_logprobs": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    want = chat_plan(runner, body)
    req = ChatRequest(_user("hi there"), "chatcmpl-abc", n=2, logprobs=3,
                      sampling={"temperature": 0.5, "top_k": 7, "seed": 11, "n_predict": 9, "stop": ["x"]},
                      stream=StreamOptions(stream=True, include_usage=True))
    got = plan_chat(runner, req)
    assert got.response_id == "chatcmpl-abc"
    assert [r.request_id for r in got.requests] == ["chatcmpl-abc-0", "chatcmpl-abc-1"]
    assert [r.prompt_token_ids for r in got.requests] == [r.prompt_token_ids for r in want.requests]
    assert [r.params for r in got.requests] == [r.params for r in want.requests]
    assert [r.params.seed for r in got.requests] == [11, 12]  # choice i samples with seed + i
    assert got.requests[0].params.n_probs == 3 and got.requests[0].params.n_predict == 9
    assert (got.n, got.stream, got.include_usage, got.logprobs, got.role) == (2, True, True, 3, "assistant")


def test_the_openai_face_reads_its_fields_into_the_request(runner):
    body = {"messages": _user("a"), "max_completion_tokens": 5, "max_tokens": 7, "id_slot": 0,
            "cache_salt": "s", "continue_final_message": False, "reasoning_effort": "low",
            "chat_template_kwargs": {"x": 1}, "thinking_token_budget": 4, "skip_special_tokens": False}
    req = chat_request(runner, body)
    assert req.request_id.startswith("chatcmpl-") and len(req.request_id) == len("chatcmpl-") + 32
    assert req.sampling == {"n_predict": 5}  # max_completion_tokens wins over max_tokens
    assert (req.id_slot, req.cache_salt, req.n_predict_is_default) == (0, "s", False)
    assert req.template == TemplateOptions(add_generation_prompt=None, continue_final_message=False,
                                           variables={"x": 1}, documents=None)
    assert req.reasoning == ReasoningOptions(format=None, include=True, budget=4, effort="low")
    assert (req.skip_special_tokens, req.spaces_between_special_tokens) == (False, True)


def test_the_openai_face_leaves_keep_alive_to_the_model_lease(runner):
    """The render route (/v1/chat/completions/render) never read keep_alive: a value the lease
    would refuse must not become a 400 there."""
    req = chat_request(runner, {"messages": _user("a"), "keep_alive": "not a duration", "model": "x"})
    assert (req.keep_alive, req.model) == (None, "x")


def test_a_default_limit_is_capped_and_a_requested_one_refused(runner):
    """Ollama's rule as a field: a default n_predict is capped to the context's room."""
    ask = dict(sampling={"n_predict": 10_000})
    capped = plan_chat(runner, ChatRequest(_user("hi"), "r", n_predict_is_default=True, **ask))
    n_prompt = len(capped.requests[0].prompt_token_ids)
    assert capped.requests[0].params.n_predict == N_CTX - n_prompt
    with pytest.raises(ContextSizeExceededError) as e:
        plan_chat(runner, ChatRequest(_user("hi"), "r", **ask))
    assert (e.value.n_prompt_tokens, e.value.n_ctx) == (n_prompt, N_CTX)


def test_continuing_the_final_message_renders_no_generation_prompt(runner):
    msgs = [*_user("hi"), {"role": "assistant", "content": "Hel"}]
    cont = plan_chat(runner, ChatRequest(msgs, "r"))  # None: the final assistant message is continued
    fresh = plan_chat(runner, ChatRequest(msgs, "r", template=TemplateOptions(continue_final_message=False)))
    text = runner.tokenizer.decode(cont.requests[0].prompt_token_ids)
    assert text.endswith("Hel") and cont.mode.prefill == "Hel" and cont.role == "assistant"
    assert runner.tokenizer.decode(fresh.requests[0].prompt_token_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("req_kw, err, text", [
    (dict(messages=[{"role": "nobody", "content": "x"}]), InvalidInputError,
     "messages[0].role: unknown role 'nobody'; expected one of system, developer, user, assistant, tool, "
     "function, ipython"),
    (dict(messages=[*_user("a"), {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}]),
     InvalidInputError, "Cannot have 2 or more assistant messages at the end of the list."),
    (dict(messages=_user("a"), id_slot=3), InvalidInputError, "Invalid id_slot: 3"),
    (dict(messages=_user("a"), sampling={"top_p": 2.0}), InvalidInputError, None),
])
def test_planner_errors_are_domain_errors_with_the_faces_texts(runner, req_kw, err, text):
    """The planner raises domain errors; the OpenAI face answers them with the same text as before."""
    with pytest.raises(err) as e:
        plan_chat(runner, ChatRequest(request_id="r", **req_kw))
    if text is not None:
        assert str(e.value) == text
    body = {"messages": req_kw["messages"], **({"id_slot": req_kw["id_slot"]} if "id_slot" in req_kw else {}),
            **req_kw.get("sampling", {})}
    with pytest.raises((ApiError, InvalidInputError)) as face:
        chat_plan(runner, body)
    assert ApiError.from_exception(face.value).body() == {"error": {"code": 400, "message": str(e.value),
                                                                   "type": "invalid_request_error"}}


def test_face_field_errors_keep_their_texts(runner):
    cases = [({"messages": None}, "'messages' is required"),
             ({"messages": _user("a"), "top_logprobs": 2}, "top_logprobs requires logprobs to be set to true"),
             ({"messages": _user("a"), "reasoning_format": "x"},
              "Field 'reasoning_format': expected none, auto, deepseek or deepseek-legacy, got 'x'"),
             ({"messages": _user("a"), "thinking_token_budget": -2},
              "Field 'thinking_token_budget': must be -1 (no limit) or >= 0"),
             ({"messages": _user("a"), "continue_final_message": True, "add_generation_prompt": True},
              "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
             ({"messages": _user("a"), "chat_template_kwargs": {"tools": []}},
              "Field 'chat_template_kwargs': key 'tools' is reserved: set it with the request's own 'tools' field")]
    for body, text in cases:
        with pytest.raises(ApiError) as e:
            chat_plan(runner, body)
        assert (e.value.status, e.value.message) == (400, text)


def _ollama_call(body: dict, model_params: dict | None = None):
    from kvserve.faces.ollama_api import _Call, ollama_options

    return _Call("chat", "m", body, stream=False, keep_alive=None, t0=0,
                 options=ollama_options(model_params, body.get("options")))


def test_ollama_options_become_typed_sampling_fields(runner):
    from kvserve.faces.ollama_api import _chat_request, _rules

    call = _ollama_call({"messages": _user("hi"), "options": {"temperature": 0.25, "seed": -5, "top_k": -1,
                                                              "stop": ["a", "b"], "num_predict": 7}})
    req = _chat_request(call, runner, _rules(call, runner), _user("hi"))
    assert req.sampling == {"top_k": 0, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0, "repeat_last_n": 64,
                            "temperature": 0.25, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "seed": SEED_RANDOM, "n_predict": 7, "stop": ("a", "b")}
    assert (req.n_predict_is_default, req.tools, req.tool_choice, req.model) == (False, None, "none", "m")
    assert req.reasoning == ReasoningOptions(format="none")  # ChatML: no thinking, never split
    params = plan_chat(runner, req).requests[0].params
    assert (params.seed, params.top_k, params.n_predict, params.stop, params.n_predict_default) == \
        (SEED_RANDOM, 0, 7, ("a", "b"), False)  # a negative seed: random


def test_ollama_num_predict_from_the_model_is_a_default_capped_to_the_context(runner):
    """Ollama's rule as a field of the typed request (no private body key any more)."""
    from kvserve.faces.ollama_api import _chat_request, _rules

    layered = _ollama_call({"messages": _user("hi")}, {"num_predict": 10_000})
    req = _chat_request(layered, runner, _rules(layered, runner), _user("hi"))
    assert (req.sampling["n_predict"], req.n_predict_is_default) == (10_000, True)
    r = plan_chat(runner, req).requests[0]
    assert r.params.n_predict == N_CTX - len(r.prompt_token_ids)
    own = _ollama_call({"messages": _user("hi"), "options": {"num_predict": 10_000}})
    req = _chat_request(own, runner, _rules(own, runner), _user("hi"))
    assert req.n_predict_is_default is False
    with pytest.raises(ContextSizeExceededError):
        plan_chat(runner, req)


def test_ollama_think_on_a_model_without_thinking_is_ollamas_400(runner):
    from kvserve.faces.ollama_api import _rules

    with pytest.raises(ApiError) as e:
        _rules(_ollama_call({"messages": _user("hi"), "think": True}), runner)
    assert (e.value.status, e.value.message) == (400, '"m" does not support thinking')


def test_a_responses_turn_is_completed_with_the_model_and_planned(runner):
    """Responses: the extension fields are read once the model is known, with the chat route's checks."""
    from kvserve.faces.responses import chat_body
    from kvserve.faces.responses import chat_request as responses_request
    from kvserve.serving.response_store import ResponseStore

    turn = chat_body({"input": "hi", "instructions": "Be brief.", "top_k": 3, "seed": 9, "max_output_tokens": 7,
                      "reasoning": {"effort": "none"}, "stop": "x"}, ResponseStore())
    req = responses_request(runner, turn)
    assert req.sampling == {"top_k": 3, "seed": 9, "stop": ("x",), "n_predict": 7}
    assert (req.template.variables, req.reasoning.budget, req.reasoning.effort) == ({"enable_thinking": False}, 0,
                                                                                  "none")
    p = plan_chat(runner, req).requests[0].params
    assert (p.top_k, p.seed, p.stop, p.n_predict) == (3, 9, ("x",), 7)
    many = chat_body({"input": "hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(600)]},
                     ResponseStore())
    assert len(many.chat.tools) == 600  # translated; the bound is the chat route's, checked with the model
    with pytest.raises(ApiError) as e:
        responses_request(runner, many)
    assert e.value.message == "Field 'tools': at most 512 tools per request, got 600"
    with pytest.raises(ApiError) as e:
        responses_request(runner, chat_body({"input": "hi", "seed": "s"}, ResponseStore()))
    assert e.value.message == "Field 'seed': type must be number, but is string"


_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")
_UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
              "Refused request with untrusted chat template.")


@pytest.mark.parametrize("field", [{"chat_template": _TEMPLATE}, {"chat_template_kwargs": {"chat_template": _TEMPLATE}}])
def test_a_request_chat_template_is_refused_untrusted_as_vllm_does(runner, field):
    """vLLM refuses a request's chat template (the field, or the key of chat_template_kwargs)
    without --trust-request-chat-template, with a 400 and these words; it was ignored silently."""
    with pytest.raises(ApiError) as e:
        chat_request(runner, {"messages": _user("hi"), **field})
    assert (e.value.status, e.value.message) == (400, _UNTRUSTED)
    # null is no template (vLLM's check is "is not None")
    assert chat_request(runner, {"messages": _user("hi"), "chat_template": None}).template.chat_template is None


def test_a_trusted_request_chat_template_renders_the_prompt(runner, monkeypatch):
    """Under --trust-request-chat-template the request's template renders its prompt (vLLM)."""
    monkeypatch.setattr(runner.args, "trust_request_chat_template", True)
    req = chat_request(runner, {"messages": _user("hi"), "chat_template": _TEMPLATE,
                                "chat_template_kwargs": {"chat_template": "x", "y": 1}})
    assert (req.template.chat_template, req.template.variables) == (_TEMPLATE, {"y": 1})
    req.verbose = True
    plan = plan_chat(runner, req)
    assert plan.verbose == {"prompt": "[user]hi[assistant]"}
    assert plan.requests[0].prompt_token_ids == runner.tokenizer.encode("[user]hi[assistant]", add_special=True,
                                                                        parse_special=True)
    model = plan_chat(runner, ChatRequest(_user("hi"), "r", verbose=True))  # the model's own template
    assert model.verbose["prompt"] != "[user]hi[assistant]"
    with pytest.raises(ApiError) as e:
        chat_request(runner, {"messages": _user("hi"), "chat_template": 5})
    assert (e.value.status, e.value.message) == (400, "Field 'chat_template': type must be string, but is number")
    with pytest.raises(InvalidInputError, match=r"^chat_template: chat template syntax error at line 1"):
        plan_chat(runner, ChatRequest(_user("hi"), "r", template=TemplateOptions(chat_template="{% if %}")))


def test_vllm_tokenize_takes_a_request_chat_template_under_the_same_rule(runner, monkeypatch):
    """vLLM's /tokenize (TokenizeChatRequest) has ``chat_template`` too, refused the same way."""
    from kvserve.faces.llama_api import vllm_tokenize

    body = {"messages": _user("hi"), "chat_template": _TEMPLATE}
    with pytest.raises(ApiError) as e:
        vllm_tokenize(runner, body)
    assert (e.value.status, e.value.message) == (400, _UNTRUSTED)
    monkeypatch.setattr(runner.args, "trust_request_chat_template", True)
    got = vllm_tokenize(runner, body)
    assert got.tokens == runner.tokenizer.encode("[user]hi[assistant]", add_special=False, parse_special=True)
    assert got.count == len(got.tokens)
