"""``kvserve.LLM``: offline batch generation from Python, no server.

Example::

    from kvserve import LLM, SamplingParams
    llm = LLM("smollm2")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, n_predict=8))
    print(outs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore, create_engine_core
from kvserve.engine.request import Request, SamplingParams, TokenLogprob
from kvserve.serving.admission import admit


@dataclass
class Completion:
    """Result of one prompt: text, token ids, stop_type ("eos"|"limit"|"word"), counts, logprobs."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    stop_type: str
    stopping_word: str = ""
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list | None = None


class LLM:
    """Load a model once and generate for many prompts with continuous batching.

    Args:
        model: cached name ("smollm2"), .gguf path or HF directory.
        config: EngineConfig (defaults: model context, 4 slots, f16 KV).
        **kwargs: EngineConfig fields as keywords (e.g. n_ctx=2048, n_parallel=16).
    """

    def __init__(self, model: str | EngineCore, config: EngineConfig | None = None, **kwargs):
        if config is None:
            config = EngineConfig(**kwargs)
        self.core = model if isinstance(model, EngineCore) else create_engine_core(model, config)
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | list[SamplingParams] | None = None,
                 add_special: bool = True) -> list[Completion]:
        """Generate for each prompt (text, or a list of token ids); returns Completions in order.

        Each request is admitted as a server's are (:func:`kvserve.serving.admission.admit`: a
        ``SamplingParams(n_predict_default=True)`` limit is capped to the context's room).

        Raises InvalidRequestError / ContextSizeExceededError for a bad prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = []
        for prompt, p in zip(prompts, plist):
            ids = self.tokenizer.encode(prompt, add_special=add_special, parse_special=True) \
                if isinstance(prompt, str) else list(prompt)
            req = Request(f"llm-{next(self._ids)}", ids, p)
            admit(req, n_ctx_slot=self.core.n_ctx_slot, n_vocab=self.core.model_config.n_vocab)
            self.core.add_request(req)
            reqs.append((prompt, req))
        results: dict[str, Completion] = {
            r.request_id: Completion(pr, "", [], "none", num_prompt_tokens=len(r.prompt_token_ids)) for pr, r in reqs
        }
        pending = set(results)
        while pending:
            for out in self.core.step():
                c = results[out.request_id]
                c.text += out.text
                c.token_ids += out.new_token_ids
                if out.logprobs:
                    c.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.stop_type, c.stopping_word = out.stop_type, out.stopping_word
                    pending.discard(out.request_id)
        return [results[r.request_id] for _, r in reqs]
