"""kvserve: one Python LLM inference server (llama-server, OpenAI and Ollama APIs) over a paged-KV engine."""

import os as _os

__version__ = "0.1.0"

# torch's OpenMP threads spin while waiting for work by default; when the cores
# are shared (other processes, several servers, CI) a spinning thread that lost
# its core stalls every parallel region: measured here, a decode step went from
# 53 ms to 1.8 s under load. Passive waiting avoids that; set it before torch
# loads (users can still override it in the environment).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvserve.engine.request import SamplingParams  # noqa: E402


def __getattr__(name):
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
