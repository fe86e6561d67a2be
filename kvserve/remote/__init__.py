"""Remote models: a model name kvserve serves whose answers come from another server
(seed 004 Example 13, "Integration B"): vLLM, llama-server, another kvserve or a hosted
OpenAI-compatible API (dialect ``openai``: chat completions), or an Ollama (dialect ``ollama``:
``/api/chat``).

- :class:`RemoteSpec` says where (``--remote name=URL[,key=ENV_VAR][,model=NAME][,dialect=...]``,
  :func:`parse_remote`; or a Modelfile, see ``docs/remote-models.md``). The key stays in its
  environment variable: never in a repr, a log line, ``/props``, ``/v1/models``, ``show`` or an
  error text.
- :func:`check_remote` is the start-up check (also run by ``kvserve show``): ``ok`` listing the
  upstream's models, ``rejected`` (check the API key) or ``no_server`` (no server at the base URL),
  each with its own message (:class:`RemoteCheck`), bounded in time.
- :class:`RemoteRunner` is what the model manager holds for it, as it holds a loaded model. Every
  face drives it the same way as a local runner: :func:`kvserve.serving.chat_plan.plan_chat`
  hands the face's :class:`~kvserve.serving.chat_request.ChatRequest` to
  :meth:`RemoteRunner.plan_chat` (kept whole: messages, tools, sampling, response format go
  upstream) and :func:`kvserve.serving.choices.chat_events` yields
  :meth:`RemoteRunner.chat_events`: the upstream's stream as kvserve's typed pieces
  (:class:`~kvserve.serving.chat_output.TextPiece`, ``ReasoningPiece``, ``ToolCallPiece``), its
  finish and its usage. So the OpenAI (chat completions, Responses), Anthropic and Ollama faces
  all reach a remote model with no code of their own.

A supervised engine (a child process kvserve starts, serving on loopback) is served the same way:
its supervisor builds a RemoteRunner for the child's URL in the model manager's loader and
stops the child in ``on_close``::

    from kvserve.remote import RemoteRunner, RemoteSpec

    def load(spec):                      # the manager's loader, for a ModelSpec it owns
        child = start_child(spec)        # e.g. llama-server / vllm serve on a free port
        remote = RemoteSpec(spec.name, f"http://127.0.0.1:{child.port}/v1", dialect="openai",
                            model=child.served_name)
        return RemoteRunner(remote, args, model_spec=spec, build_info=build_info,
                            on_close=child.stop)

With ``model_spec`` the supervisor's own ModelSpec (not pinned, not ``remote``) keep_alive and
eviction unload it like a local model, and :meth:`RemoteRunner.close` calls ``on_close``; its
``measured_bytes`` (0) may be set to the child's resident size. ``RemoteRunner.check()`` runs
the start-up check against the child (``/v1/models``).
"""

from kvserve.remote.check import RemoteCheck, check_remote
from kvserve.remote.runner import RemoteRunner, estimate_tokens
from kvserve.remote.spec import (
    DIALECTS,
    REMOTE_NOT_ALLOWED,
    RemoteSpec,
    parse_remote,
    redact_url,
    remote_host_allowed,
)

__all__ = ["DIALECTS", "RemoteCheck", "RemoteRunner", "RemoteSpec", "check_remote", "estimate_tokens",
           "parse_remote", "redact_url", "remote_host_allowed", "REMOTE_NOT_ALLOWED"]
