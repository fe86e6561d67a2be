"""The runner protocol (kvserve/serving/runner_protocol.py): a generative Runner and an
EmbeddingRunner both implement what a face may ask of a runner, and an encoder refuses generation
by saying so (require_generative), not by an engine core that raises on any attribute."""

from __future__ import annotations

import pytest

from kvserve.errors import NotSupportedError
from kvserve.serving.args import parse_args
from kvserve.serving.chat_plan import plan_chat
from kvserve.serving.chat_request import ChatRequest
from kvserve.serving.completion_plan import plan_completion
from kvserve.serving.completion_request import CompletionRequest
from kvserve.serving.embed_runner import EmbeddingRunner
from kvserve.serving.manager import ModelSpec
from kvserve.serving.chat_runner import load_runner
from kvserve.serving.runner_protocol import EngineFacts, ModelRunner


class _Tok:
    bos_token = eos_token = ""
    n_vocab = 10


class _Encoder:
    def __init__(self):
        from kvserve.loaders.weights import ModelInfo

        self.tokenizer = _Tok()
        self.model_info = ModelInfo(path="", name="fake", format="safetensors", arch="bert", ftype="F32",
                                    n_params=1, size=4, n_vocab=10, n_ctx_train=16, n_embd=4)
        self.task, self.n_ctx, self.dim, self.error = "embed", 16, 4, None

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def runner(tiny_gguf):
    args = parse_args(["-m", tiny_gguf, "--device", "cpu", "--cache-ram", "0", "-c", "64", "-np", "1"], environ={})
    r = load_runner(args, ModelSpec("m", tiny_gguf), "test")
    yield r
    r.close()


def test_both_runners_implement_the_protocol(runner):
    enc = EmbeddingRunner(parse_args([]), ModelSpec("enc"), _Encoder(), "b0")
    for r, task in ((runner, "generate"), (enc, "embed")):
        assert isinstance(r, ModelRunner) and isinstance(r.engine, EngineFacts)
        assert (r.task, r.device, r.engine_counts()) == (task, "cpu", (0, 0, 0.0))
    runner.require_generative()  # nothing to refuse
    assert not hasattr(enc.engine, "core")  # no impostor engine core
    assert enc.generation is None


def test_an_encoder_refuses_generation_before_anything_is_planned():
    enc = EmbeddingRunner(parse_args([]), ModelSpec("enc"), _Encoder(), "b0")
    text = "model 'enc' is an embedding model: it does not generate text (use /v1/embeddings)"
    with pytest.raises(NotSupportedError, match=text.replace("(", r"\(").replace(")", r"\)")):
        enc.require_generative()
    with pytest.raises(NotSupportedError, match="is an embedding model"):
        plan_chat(enc, ChatRequest(messages=[{"role": "user", "content": "hi"}], request_id="chatcmpl-1"))
    with pytest.raises(NotSupportedError, match="is an embedding model"):
        plan_completion(enc, CompletionRequest(prompts=["hi"], request_id="cmpl-1"))
