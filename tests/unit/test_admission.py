"""Admission (issue #33, build 2): the serving layer checks and normalizes a request once
(kvserve.serving.admission.admit); the engine re-checks its invariants without changing params."""

from __future__ import annotations

import pytest

from kvserve.engine.fake import expected_tokens, fake_engine_core
from kvserve.engine.request import ContextSizeExceededError, InvalidRequestError, Request, SamplingParams, check_prompt
from kvserve.errors import InvalidInputError
from kvserve.llm import LLM
from kvserve.serving.admission import admit, fit_default_n_predict


def test_check_prompt_texts():
    check_prompt([0, 63], 10, 12, 64)  # fits: 2 + 10 = 12
    with pytest.raises(InvalidRequestError) as e:
        check_prompt([], 1, 12, 64)
    assert str(e.value) == "the prompt is empty: at least one token is required"
    with pytest.raises(InvalidRequestError) as e:  # the first id out of range, in prompt order
        check_prompt([5, 64, -1, 99], 1, 100, 64)
    assert str(e.value) == "token id 64 is out of range (vocabulary size 64)"
    with pytest.raises(InvalidRequestError) as e:
        check_prompt([5, -3, 70], 1, 100, 64)
    assert str(e.value) == "token id -3 is out of range (vocabulary size 64)"
    with pytest.raises(ContextSizeExceededError) as e:
        check_prompt([1, 2], 11, 12, 64)
    assert (e.value.n_prompt_tokens, e.value.n_ctx, e.value.n_predict) == (2, 12, 11)
    with pytest.raises(ContextSizeExceededError) as e:  # a full context leaves nothing to generate
        check_prompt(list(range(12)), -1, 12, 64)
    assert str(e.value) == "request (12 tokens) exceeds the available context size (12 tokens), try increasing it"


def test_a_default_limit_is_capped_and_a_requested_one_kept():
    default = SamplingParams(n_predict=100, n_predict_default=True)
    assert fit_default_n_predict(default, 10, 64).n_predict == 54
    assert fit_default_n_predict(default, 10, 200) is default  # room enough: unchanged
    own = SamplingParams(n_predict=100)
    assert fit_default_n_predict(own, 10, 64) is own
    assert fit_default_n_predict(SamplingParams(n_predict=-1, n_predict_default=True), 10, 64).n_predict == -1


def test_admit_normalizes_then_checks():
    req = Request("a", [1, 2, 3], SamplingParams(n_predict=500, n_predict_default=True), priority_slot=1)
    admit(req, n_ctx_slot=64, n_vocab=64, n_slots=2)
    assert (req.params.n_predict, req.params.n_predict_default) == (61, True)
    with pytest.raises(ContextSizeExceededError):
        admit(Request("b", [1, 2, 3], SamplingParams(n_predict=500)), n_ctx_slot=64, n_vocab=64)
    with pytest.raises(InvalidInputError) as e:
        admit(Request("c", [1], SamplingParams(), priority_slot=2), n_ctx_slot=64, n_vocab=64, n_slots=2)
    assert str(e.value) == "Invalid id_slot: 2"
    admit(Request("d", [1], SamplingParams(), priority_slot=5), n_ctx_slot=64, n_vocab=64)  # no slots to check


def test_the_engine_checks_and_never_rewrites_params():
    core = fake_engine_core(n_ctx=128, n_parallel=2)  # 64 tokens a slot
    params = SamplingParams(n_predict=500, n_predict_default=True)
    req = Request("x", [3, 4, 5], params)
    with pytest.raises(ContextSizeExceededError):  # not admitted: the engine refuses, as is
        core.add_request(req)
    assert req.params is params and req.params.n_predict == 500
    admit(req, n_ctx_slot=core.n_ctx_slot, n_vocab=core.model_config.n_vocab)
    core.add_request(req)
    assert req.params.n_predict == 61


def test_llm_admits_as_the_server_does():
    core = fake_engine_core(n_ctx=32, n_parallel=1, n_vocab=64)
    llm = LLM(core)
    p = SamplingParams(temperature=0.0, n_predict=1000, n_predict_default=True, ignore_eos=True)
    (out,) = llm.generate([[3, 4, 5, 6]], p)
    assert out.token_ids == expected_tokens([3, 4, 5, 6], 28, 64) and out.stop_type == "limit"
    with pytest.raises(ContextSizeExceededError) as e:
        llm.generate([[3, 4, 5, 6]], SamplingParams(n_predict=1000))
    assert str(e.value) == ("request (4 prompt tokens + 1000 requested tokens = 1004 tokens) exceeds the available "
                            "context size (32 tokens), try lowering n_predict/max_tokens or increasing the context")
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[3, 64]], SamplingParams())
    assert str(e.value) == "token id 64 is out of range (vocabulary size 64)"
