"""Supervised engines (seed 004 Example 12, "Integration A"): a model kvserve serves through an
engine it starts as a child process, for the formats kvserve does not run itself (an MLX,
EXL2 or TensorRT-LLM folder, a GGUF of a family kvserve lacks, a safetensors checkpoint on a GPU
box where ``vllm serve`` is installed), or any OpenAI-compatible server the operator names.

- :class:`EngineSpec` / :func:`parse_engine`: ``kvserve serve --engine NAME=COMMAND`` (the
  command holds ``{port}``; see :mod:`kvserve.supervisor.spec`). Configured by the operator
  (flag), never by a request body.
- :class:`EngineChild`: the process: a free loopback port, its log in kvserve's (``[NAME] ...``),
  ``/health`` polled with backoff (503 while loading), SIGTERM then SIGKILL, dies with kvserve
  (PR_SET_PDEATHSIG, its own process group), restarted once if it dies while serving.
- :func:`load_supervised` / :class:`SupervisedRunner`: the model manager's loader for it; the
  child is then served exactly as a remote model (:class:`kvserve.remote.RemoteRunner`) at its
  loopback URL, and unloading the model (keep_alive, ``keep_alive: 0``, eviction, shutdown) stops
  the child.
"""

from kvserve.supervisor.child import EngineChild, EngineStartError, free_port
from kvserve.supervisor.runner import SupervisedRunner, load_supervised
from kvserve.supervisor.spec import EngineSpec, parse_engine

__all__ = ["EngineChild", "EngineSpec", "EngineStartError", "SupervisedRunner", "free_port", "load_supervised",
           "parse_engine"]
