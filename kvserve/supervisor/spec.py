"""What a supervised engine is: :class:`EngineSpec` (a served name and the command that starts the
engine) and :func:`parse_engine` for ``--engine NAME=COMMAND``.

The command is a shell-quoted command line (split with :func:`shlex.split`, never run through a
shell) with placeholders kvserve fills when it starts the child:

- ``{port}`` (required): the free loopback port kvserve picked for it;
- ``{host}``: ``127.0.0.1`` (the child must listen on loopback only);
- ``{model}``: the model path of a Modelfile's ``FROM`` (empty with ``--engine``, where the
  command names its model itself).

Examples::

    --engine 'smol=llama-server -m /models/smollm2.gguf --host {host} --port {port}'
    --engine 'qwen=vllm serve /models/Qwen2.5-7B-Instruct --host {host} --port {port}'
"""

from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass

from kvserve.errors import InvalidInputError

__all__ = ["HOST", "EngineSpec", "parse_engine", "shown_command"]

#: where every child listens
HOST = "127.0.0.1"

_NAME = re.compile(r"[^\s,=]{1,256}")
#: an environment name or option that holds a secret (``HF_TOKEN=``, ``OPENAI_API_KEY=``, ``--api-key``)
#: (one of its ``-``/``_``-separated words is one of these: ``--tokenizer`` and ``--ssl-keyfile`` are not)
_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pwd", "auth", "credential",
                           "credentials", "cookie"})
#: values shaped like well-known keys, wherever they stand (OpenAI, Anthropic, Hugging Face, GitHub)
_SECRET_VALUE = re.compile(r"(sk-|sk_|hf_|ghp_|gho_|github_pat_|xox[bp]-)[A-Za-z0-9_-]{8,}")
_REDACTED = "***"
_FIELDS = ("port", "host", "model")


@dataclass(frozen=True)
class EngineSpec:
    """One supervised engine: the model name kvserve serves and the command line of the child
    process that serves it (an OpenAI-compatible server: llama-server, ``vllm serve``,
    ``trtllm-serve``, ``mlx_lm.server``, another kvserve...).

    Attributes:
        name: the model name clients use at kvserve.
        argv: the command line, its words holding ``{port}``/``{host}``/``{model}`` placeholders.
        model: the value of ``{model}`` ("" when the command names its model itself).
        start_timeout_s: seconds the child may take to answer 200 on ``/health``.

    Raises:
        InvalidInputError: an empty command, no ``{port}`` in it, an unknown ``{placeholder}``,
            or a bad name.
    """

    name: str
    argv: tuple[str, ...]
    model: str = ""
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.name or not _NAME.fullmatch(self.name):
            raise InvalidInputError(f"engine model name {self.name[:64]!r}: 1-256 characters without spaces, "
                                    "',' or '='")
        if not self.argv:
            raise InvalidInputError(f"engine '{self.name}': the command is empty")
        if not any("{port}" in w for w in self.argv):
            raise InvalidInputError(f"engine '{self.name}': the command must pass {{port}} to the engine (kvserve "
                                    "picks a free loopback port), e.g. --port {port}")
        for w in self.argv:
            for f in re.findall(r"\{([^{}]*)\}", w):
                if f not in _FIELDS:
                    raise InvalidInputError(f"engine '{self.name}': unknown placeholder {{{f[:32]}}} (use {{port}}, "
                                            "{host}, {model})")
        if self.start_timeout_s <= 0:
            raise InvalidInputError(f"engine '{self.name}': the start timeout must be positive")

    def command(self, port: int) -> list[str]:
        """The command line for a child on ``port``."""
        return [w.replace("{port}", str(port)).replace("{host}", HOST).replace("{model}", self.model)
                for w in self.argv]

    @property
    def program(self) -> str:
        """The executable's name as given (``llama-server``, ``vllm``)."""
        return self.argv[0]

    def installed(self) -> bool:
        """True when the executable is on PATH (or a path to an executable file)."""
        return shutil.which(self.argv[0]) is not None


def _secret_name(name: str) -> bool:
    return any(w in _SECRET_WORDS for w in re.split(r"[-_]+", name.lower()))


def shown_command(argv: tuple[str, ...] | list[str]) -> str:
    """The command line as ``show`` and logs print it, with values that look like keys written
    ``***``: an environment assignment whose name names a secret (``env HF_TOKEN=*** vllm ...``,
    ``OPENAI_API_KEY=***``), the value of an option that does (``--api-key ***``,
    ``--hf-token=***``), and any word shaped like a well-known key (``sk-...``, ``hf_...``).
    Shell-quoted (:func:`shlex.join`) so it reads as the ``ENGINE`` line it came from."""
    out: list[str] = []
    hide_next = False
    for w in argv:
        if hide_next:
            out.append(_REDACTED)
            hide_next = False
            continue
        if w.startswith("-"):
            opt, eq, _ = w.partition("=")
            if _secret_name(opt):
                if eq:
                    out.append(f"{opt}={_REDACTED}")
                else:
                    out.append(w)
                    hide_next = True
                continue
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w, re.DOTALL):
            name, _, value = w.partition("=")
            if _secret_name(name) and value:
                out.append(f"{name}={_REDACTED}")
                continue
        out.append(_SECRET_VALUE.sub(_REDACTED, w))
    return shlex.join(out)


def parse_engine(value: str, start_timeout_s: float = 600.0) -> EngineSpec:
    """``NAME=COMMAND`` (``--engine``) -> EngineSpec.

    Raises:
        InvalidInputError: no ``=``, a command that does not split (an open quote), or what
            :class:`EngineSpec` refuses.
    """
    if not isinstance(value, str) or "=" not in value:
        raise InvalidInputError("--engine takes NAME=COMMAND, the command holding {port} "
                                "(e.g. 'smol=llama-server -m x.gguf --port {port}')")
    name, _, cmd = value.partition("=")
    try:
        argv = tuple(shlex.split(cmd))
    except ValueError as e:
        raise InvalidInputError(f"engine '{name.strip()}': the command does not parse: {e}") from None
    return EngineSpec(name.strip(), argv, start_timeout_s=start_timeout_s)
