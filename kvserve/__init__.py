"""kvserve: one Python LLM inference server (llama-server, OpenAI and Ollama APIs) over a paged-KV engine."""

__version__ = "0.1.0"

from kvserve.engine.request import SamplingParams  # noqa: E402


def __getattr__(name):
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
