"""kvserve's typed raw-prompt request and its one planner
(kvserve.serving.completion_plan.plan_completion), in process on the tiny random GGUF: a request
built without any face plans to the same engine requests as the OpenAI face's body, the faces'
rules (seeds per prompt, the default limit, empty prompts, fill-in-the-middle) are fields of the
request, and the errors keep their texts."""

from __future__ import annotations

import pytest

from kvserve.engine.request import ContextSizeExceededError, InvalidRequestError
from kvserve.errors import InvalidInputError
from kvserve.loaders.tokenizer import TooManyTokensError
from kvserve.faces.api_error import ApiError
from kvserve.faces.openai import completion_plan, completion_request
from kvserve.serving.args import parse_args
from kvserve.serving.chat_request import StreamOptions
from kvserve.serving.completion_plan import plan_completion, prompt_ids
from kvserve.serving.completion_request import CompletionRequest, Infill
from kvserve.serving.manager import ModelSpec
from kvserve.serving.chat_runner import load_runner

N_CTX = 256
QWEN_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def _load(path: str, *extra: str):
    args = parse_args(["-m", path, "--device", "cpu", "--cache-ram", "0", "-c", str(N_CTX), "-np", "1", *extra],
                      environ={})
    return load_runner(args, ModelSpec("m", path), "test")


@pytest.fixture(scope="module")
def runner(tiny_gguf):
    r = _load(tiny_gguf)
    yield r
    r.close()


@pytest.fixture(scope="module")
def fim_runner(tmp_path_factory):
    """The tiny model with Qwen's FIM tokens; ``-b 64``: llama-server's FIM budgets follow the batch."""
    import tinymodel

    mp = pytest.MonkeyPatch()
    mp.setattr(tinymodel, "SPECIAL_TOKENS", tinymodel.SPECIAL_TOKENS + QWEN_FIM)
    try:
        path = str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("fim") / "fim.gguf"))
    finally:
        mp.undo()
    r = _load(path, "-b", "64")
    yield r
    r.close()


def _enc(runner, text: str, bos: bool = True, special: bool = True) -> list[int]:
    return runner.tokenizer.encode(text, add_special=bos, parse_special=special)


def test_a_typed_request_plans_as_the_openai_body(runner):
    body = {"prompt": ["hi there", "bye"], "temperature": 0.5, "top_k": 7, "seed": 11, "n": 2, "max_tokens": 9,
            "stop": ["x"], "logprobs": 3, "echo": True, "stream": True, "stream_options": {"include_usage": True}}
    want = completion_plan(runner, body)
    req = CompletionRequest(["hi there", "bye"], "cmpl-abc", n=2, logprobs=3, echo=True,
                            sampling={"temperature": 0.5, "top_k": 7, "seed": 11, "n_predict": 9, "stop": ("x",)},
                            stream=StreamOptions(stream=True, include_usage=True))
    got = plan_completion(runner, req)
    assert [r.request_id for r in got.requests] == [f"cmpl-abc-{k}" for k in range(4)]
    assert [r.prompt_token_ids for r in got.requests] == [r.prompt_token_ids for r in want.requests]
    assert [r.params for r in got.requests] == [r.params for r in want.requests]
    assert [r.params.seed for r in got.requests] == [11, 12, 13, 14]  # request k samples with seed + k
    p = got.requests[0].params
    assert (p.n_probs, p.prompt_logprobs, p.cache_prompt, p.n_predict) == (3, 3, False, 9)  # echo: prompt logprobs
    assert got.echo_texts == want.echo_texts == [runner.tokenizer.decode(_enc(runner, t)) for t in
                                                 ("hi there", "hi there", "bye", "bye")]
    assert (got.kind, got.n, got.stream, got.include_usage, got.logprobs) == ("text", 2, True, True, 3)


def test_the_openai_face_reads_its_fields_into_the_request(runner):
    body = {"prompt": [[1, 2], "x"], "max_tokens": 5, "n_predict": 7, "id_slot": 0, "cache_salt": "s",
            "suffix": "", "echo": True, "model": "q", "truncate_prompt_tokens": 3}
    req = completion_request(runner, body)
    assert req.request_id.startswith("cmpl-") and len(req.request_id) == len("cmpl-") + 32
    assert (req.prompts, req.infill, req.refuse_empty) == ([[1, 2], "x"], None, True)
    assert (req.sampling, req.default_n_predict) == ({"n_predict": 5}, 16)  # max_tokens wins over n_predict
    assert (req.id_slot, req.cache_salt, req.echo, req.model, req.truncate_prompt_tokens) == (0, "s", True, "q", 3)
    assert req.seed_per_request is True and req.n == 1
    assert completion_request(runner, {"prompt": "a", "n": 3}, render=True).n == 1  # render: one per prompt


def test_the_dialects_default_limit_and_the_models(runner):
    assert plan_completion(runner, CompletionRequest(["a"], "r", default_n_predict=16)).requests[0].params.n_predict == 16
    asked = CompletionRequest(["a"], "r", default_n_predict=16, sampling={"n_predict": 4})
    assert plan_completion(runner, asked).requests[0].params.n_predict == 4
    model = runner.default_params.n_predict
    assert plan_completion(runner, CompletionRequest(["a"], "r")).requests[0].params.n_predict == model


def test_a_default_limit_is_capped_and_a_requested_one_refused(runner):
    """Ollama's num_predict rule as a field: a default is capped to the context's room."""
    capped = plan_completion(runner, CompletionRequest(["hi"], "r", sampling={"n_predict": 10_000},
                                                       n_predict_is_default=True)).requests[0]
    assert capped.params.n_predict == N_CTX - len(capped.prompt_token_ids)
    with pytest.raises(ContextSizeExceededError) as e:
        plan_completion(runner, CompletionRequest(["hi"], "r", sampling={"n_predict": 10_000}))
    assert (e.value.n_prompt_tokens, e.value.n_ctx) == (len(capped.prompt_token_ids), N_CTX)


def test_seeds_per_request_or_per_choice(runner):
    """OpenAI: request k over prompts and choices samples with seed + k; llama-server's /completion:
    every prompt keeps the seed, only a prompt's choices differ."""
    kw = dict(n=2, sampling={"seed": 7})
    per_request = plan_completion(runner, CompletionRequest(["a", "b"], "r", **kw))
    per_choice = plan_completion(runner, CompletionRequest(["a", "b"], "r", seed_per_request=False, **kw))
    assert [r.params.seed for r in per_request.requests] == [7, 8, 9, 10]
    assert [r.params.seed for r in per_choice.requests] == [7, 8, 7, 8]


def test_mixed_prompts_get_bos_on_a_first_text_only(runner):
    ids = prompt_ids(runner, CompletionRequest(["hi", [5, "hi", 6], ["hi", 5]], "r"))
    assert ids == [_enc(runner, "hi"), [5, *_enc(runner, "hi", bos=False), 6], [*_enc(runner, "hi"), 5]]


def test_truncation_keeps_the_last_tokens_and_skips_the_size_check(runner):
    long = "word " * 2000  # cannot fit: refused before tokenizing unless it is truncated
    with pytest.raises(TooManyTokensError):
        prompt_ids(runner, CompletionRequest([long], "r"))
    ids = prompt_ids(runner, CompletionRequest([long], "r", truncate_prompt_tokens=10))
    assert ids == [_enc(runner, long)[-10:]]


@pytest.mark.parametrize("req_kw, text", [
    (dict(prompts=[[1, 10_000_000]]), "Field 'prompt': token id 10000000 out of range [0, {n})"),
    (dict(prompts=[[]], refuse_empty=True), "Field 'prompt': the prompt is empty"),
    (dict(prompts=[[]]), "the prompt is empty: at least one token is required"),  # the engine's
    (dict(prompts=["a"], id_slot=3), "Invalid id_slot: 3"),
])
def test_planner_errors_are_domain_errors_with_the_faces_texts(runner, req_kw, text):
    with pytest.raises((InvalidInputError, InvalidRequestError)) as e:
        plan_completion(runner, CompletionRequest(request_id="r", **req_kw))
    want = text.format(n=runner.tokenizer.n_vocab)
    assert str(e.value) == want
    assert ApiError.from_exception(e.value).body() == {"error": {"code": 400, "message": want,
                                                                 "type": "invalid_request_error"}}


@pytest.mark.parametrize("prompt, status, text", [
    (None, 400, "'prompt' is required"),
    ([], 400, "Field 'prompt': must not be empty"),
    ({"a": 1}, 400, "Field 'prompt': type must be string or array, but is object"),
    ([1, None], 400, "Field 'prompt': elements must be token ids or strings"),
    # a list of prompts holding something that is no prompt: a 400 (it was a 500, or its keys tokenized)
    ([[1, 2], 5], 400, "Field 'prompt': elements must be token ids or strings"),
    ([[1, 2], {"a": 1}], 400, "Field 'prompt': elements must be token ids or strings"),
])
def test_the_openai_face_checks_the_prompts_shape(runner, prompt, status, text):
    with pytest.raises(ApiError) as e:
        completion_request(runner, {"prompt": prompt})
    assert (e.value.status, e.value.message) == (status, text)


def test_openai_suffix_and_infill_lay_out_the_same_fim_prompt(fim_runner):
    """``suffix`` on /v1/completions and /infill's parts go through one layout."""
    r = fim_runner
    t = {s: r.tokenizer.token_to_id(s) for s in QWEN_FIM}
    face = completion_request(r, {"prompt": "def f(", "suffix": "return x"})
    assert (face.prompts, face.infill, face.refuse_empty) == (["def f("], Infill("return x"), False)
    raw = [prompt_ids(r, face)[0]]
    want = ([t["<|repo_name|>"]] + _enc(r, "myproject\n", False, False) + [t["<|file_sep|>"]]
            + _enc(r, "filename\n", False, False) + [t["<|fim_prefix|>"]] + _enc(r, "def f(", False, False)
            + [t["<|fim_suffix|>"]] + _enc(r, "return x", False, False) + [t["<|fim_middle|>"]])
    assert raw == [want]
    infill = CompletionRequest(["def f("], "r", infill=Infill("return x", [("a.py", "A")], "<|fim_pad|>"))
    got = prompt_ids(r, infill)[0]
    extra = ([t["<|repo_name|>"]] + _enc(r, "myproject\n", False, False) + [t["<|file_sep|>"]]
             + _enc(r, "a.py\n", False, False) + _enc(r, "A", False, False) + [t["<|file_sep|>"]]
             + _enc(r, "filename\n", False, False))
    assert got == (extra + [t["<|fim_prefix|>"]] + _enc(r, "def f(", False, False) + [t["<|fim_pad|>"]]
                   + [t["<|fim_suffix|>"]] + _enc(r, "return x", False, False) + [t["<|fim_middle|>"]])


def test_the_openai_face_refuses_suffix_without_fim_tokens(runner):
    with pytest.raises(ApiError) as e:
        completion_request(runner, {"prompt": "a", "suffix": "b"})
    assert (e.value.status, e.value.message) == (
        400, "'suffix' is not supported by this model: prefix token is missing. suffix token is missing. "
             "middle token is missing.")


def _ollama_generate(body: dict, model_params: dict | None = None):
    from kvserve.faces.ollama_api import _Call, ollama_options

    return _Call("generate", "m", body, stream=False, keep_alive=None, t0=0,
                 options=ollama_options(model_params, body.get("options")))


def test_ollama_raw_generate_builds_the_typed_request(runner):
    from kvserve.faces.ollama_api import _completion_request, _rules

    call = _ollama_generate({"prompt": "hi", "raw": True, "format": "json",
                             "options": {"temperature": 0.25, "seed": 3, "top_k": -1, "stop": ["a"]}})
    rules = _rules(call, runner)
    req = _completion_request(call, runner, rules, [1, "hi"])
    assert req.sampling == {"top_k": 0, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0, "repeat_last_n": 64,
                            "temperature": 0.25, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "seed": 3, "n_predict": rules.n_predict, "stop": ("a",)}
    assert (req.prompts, req.refuse_empty, req.model, req.response_format) == ([[1, "hi"]], True, "m", rules.spec)
    assert req.request_id.startswith("cmpl-") and req.n_predict_is_default == rules.n_predict_is_default
    plan = plan_completion(runner, req)
    assert plan.requests[0].prompt_token_ids == [1, *_enc(runner, "hi", bos=False)]
    assert plan.requests[0].grammar is not None and plan.grammar != ""


@pytest.mark.parametrize("field, prompt, bad", [
    ("prompt", [1, None], "null"), ("input_prefix", [None], "null"), ("input_suffix", [None, "a"], "null"),
    ("prompt", [1, 1.5], "number"), ("prompt", [1, {"a": 1}], "object")])
def test_llama_prompt_value_refuses_every_bad_element(field, prompt, bad):
    """A null element of a /completion or /infill prompt is a 400 naming the field, as any other bad
    element (it was a 500: the check took the first bad element by next(..., None))."""
    from kvserve.faces.llama_api import prompt_value

    with pytest.raises(ApiError) as e:
        prompt_value(prompt, field)
    assert e.value.status == 400
    assert str(e.value.message) == (f"Field '{field}': type must be string, token id or an array of them, "
                                    f"but is {bad}")
    assert prompt_value([1, "a", 2], field) == [1, "a", 2]
