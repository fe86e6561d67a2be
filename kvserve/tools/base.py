"""The tool interface: :class:`ToolContext`, the :class:`Tool` protocol, :class:`BaseTool` (its
common fields and the ``GET /tools`` entry), :class:`ToolRegistry` and the errors a tool call raises.

No HTTP here: :mod:`kvserve.faces.tools_api` translates requests into :meth:`ToolRegistry.get` and
:meth:`Tool.run` / :meth:`Tool.stream` calls and their results and errors into llama-server's
answers (see the package docstring for the shapes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("kvserve.tools")

#: every built-in tool's name, in llama-server's order (``build_tools`` of server-tools.cpp)
BUILTIN_NAMES = ("read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file",
                 "edit_file", "get_info")


class ToolError(Exception):
    """A tool call that cannot run. ``status``: the HTTP status the face answers with (404 for an
    unknown tool or a tool that cannot stream, as llama-server; 400 for params of the wrong shape;
    500 for a runtime llama-server refuses with 500: an unknown ``x-tool-runtime`` scheme, an invalid
    container id). The message is llama-server's text where it has one."""

    status = 500

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class UnknownToolError(ToolError):
    """``unknown tool "NAME"`` (404), or ``tool "NAME" does not support stream = true`` (404)."""

    status = 404


class ToolParamsError(ToolError):
    """A required param missing or of the wrong JSON type (400; llama-server answers 400 too when
    its JSON accessors throw)."""

    status = 400


class ToolRuntimeError(ToolError):
    """An ``x-tool-runtime`` / ``--tools-runtime`` kvserve refuses: ``unknown tool runtime: X``,
    ``invalid container id: X``, ``invalid ssh target: X`` (500, llama-server's status and texts)."""

    status = 500


@dataclass
class ToolContext:
    """Where and how long one tool call runs: set by the server from the operator's flags and the
    caller's headers, never from the params a model writes.

    Attributes:
        cwd: the caller's working directory (``x-tool-cwd``; None: the server's own). Relative paths
            resolve in it, and :mod:`kvserve.tools.paths` keeps them inside it.
        runtime: the isolate spec (``x-tool-runtime`` or ``--tools-runtime``), already validated:
            ``docker-container:ID`` / ``podman-container:ID``; None runs on the host.
        resp_type: ``x-resp-type`` (``base64``: ``read_file`` answers the raw bytes base64-encoded).
        timeout_s: the most seconds the whole call may take (a shell command's own ``timeout`` param
            is capped by it too).
        cancelled: set when the caller is gone (client disconnect), the server stops, or the call's
            time is up: a tool stops its work and its processes when it is set.
        started: ``time.monotonic()`` at the call's start.
    """

    cwd: str | None = None
    runtime: str | None = None
    resp_type: str | None = None
    timeout_s: float = 120.0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        """False once the call is cancelled or past its time."""
        return not self.cancelled.is_set() and self.remaining() > 0

    def remaining(self) -> float:
        """Seconds left of :attr:`timeout_s` (may be negative)."""
        return self.timeout_s - (time.monotonic() - self.started)


@runtime_checkable
class Tool(Protocol):
    """One tool ``/tools`` lists and runs (a built-in tool, or an MCP server's tool).

    Attributes:
        name: the name ``POST /tools`` takes (``read_file``; an MCP tool's ``<server>_<tool>``).
        display_name: the page's label (``Read file``).
        type: ``"server"`` (built-in) or ``"mcp"``.
        permission_write: True when the tool can change files or run commands (the page asks the user).
        support_stream: True when :meth:`stream` exists (``stream: true`` is refused otherwise).
        uses_cwd: True when the tool resolves paths or runs commands in :attr:`ToolContext.cwd`.
    """

    name: str
    display_name: str
    type: str
    permission_write: bool
    support_stream: bool
    uses_cwd: bool

    def definition(self) -> dict:
        """The OpenAI function-tool definition ``{"type": "function", "function": {"name",
        "description", "parameters"}}`` (what a chat request's ``tools`` takes)."""
        ...

    def entry(self) -> dict:
        """This tool's ``GET /tools`` element: ``{"display_name", "tool", "type", "permissions":
        {"write"}, "uses_cwd", "definition"}`` (llama-server's ``server_tool::to_json``)."""
        ...

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        """Run once and return the answer body: ``{"plain_text_response": TEXT, ...}``, ``{"result":
        ..., ...}`` or ``{"error": TEXT}`` (a tool-level failure is answered 200 with ``error``, as
        llama-server). Raises :class:`ToolError` for what llama-server answers with 4xx/5xx."""
        ...

    def stream(self, params: dict, ctx: ToolContext) -> AsyncIterator[str]:
        """Only when :attr:`support_stream`: the output's chunks (text) as they come; the face frames
        each as ``data: {"chunk": TEXT}`` and ends with ``data: {"done": true}``. Raises
        :class:`ToolError` before the first chunk for a refused call; an exception after it ends the
        stream with ``{"done": true, "error": TEXT}``."""
        ...


class BaseTool:
    """Common fields and :meth:`entry` of a :class:`Tool`; subclasses set the class attributes and
    implement :meth:`definition` and :meth:`run` (and :meth:`stream` when ``support_stream``)."""

    name = ""
    display_name = ""
    type = "server"
    permission_write = False
    support_stream = False
    uses_cwd = False

    def definition(self) -> dict:  # pragma: no cover - every tool overrides it
        raise NotImplementedError

    def entry(self) -> dict:
        return {"display_name": self.display_name, "tool": self.name, "type": self.type,
                "permissions": {"write": self.permission_write}, "uses_cwd": self.uses_cwd,
                "definition": self.definition()}

    async def run(self, params: dict, ctx: ToolContext) -> dict:  # pragma: no cover
        raise NotImplementedError

    def stream(self, params: dict, ctx: ToolContext) -> AsyncIterator[str]:  # pragma: no cover
        raise UnknownToolError(f'tool "{self.name}" does not support stream = true')


class ToolRegistry:
    """The tools this server offers, in order: the built-in tools ``--tools`` names (``all``: every
    one), then what others add (MCP servers' tools, at warm-up). ``/tools`` answers 403 ``this feature
    is disabled`` while :attr:`enabled` is False (no ``--tools`` and nothing added), as llama-server.

    Also tracks the process groups the tools start (:meth:`track` / :meth:`untrack`) so that
    :meth:`close` (server stop) kills them all.

    Args:
        runtime: the ``--tools-runtime`` spec applied to calls without ``x-tool-runtime`` (validated).
        confine: True (``--tools-confine``) keeps absolute paths inside the call's cwd too.
    """

    def __init__(self, runtime: str | None = None, confine: bool = False):
        self._tools: dict[str, Tool] = {}
        self.enabled = False
        self.runtime = runtime
        self.confine = confine
        self._groups: set[int] = set()

    @classmethod
    def from_names(cls, names: Iterable[str] | str | None, runtime: str | None = None,
                   confine: bool = False) -> "ToolRegistry":
        """The registry of ``--tools`` (a list, or one comma-separated text; ``all`` for every
        built-in tool). Raises ValueError ``unknown tool "X". available tools: ...`` (llama-server's
        start-up text) for a name that is not a built-in tool, and :class:`ToolRuntimeError` for a
        bad ``runtime``."""
        from kvserve.tools.builtin import builtin_tools
        from kvserve.tools.runtime import parse_runtime

        if isinstance(names, str):
            names = names.split(",")
        wanted = [n.strip() for n in (names or []) if n and n.strip()]
        for n in wanted:
            if n != "all" and n not in BUILTIN_NAMES:
                raise ValueError(f'unknown tool "{n}". available tools: {", ".join(BUILTIN_NAMES)}')
        if runtime:
            parse_runtime(runtime)
        reg = cls(runtime=runtime or None, confine=confine)
        for tool in builtin_tools(confine, reg):
            if "all" in wanted or tool.name in wanted:
                reg.add(tool)
        reg.enabled = bool(wanted)
        return reg

    def add(self, tool: Tool) -> bool:
        """Add ``tool`` and enable the routes; False (and a warning) when its name is taken, as
        llama-server skips an MCP tool whose ``<server>_<tool>`` collides."""
        if tool.name in self._tools:
            log.warning('tool "%s" collides with an existing tool, skipping', tool.name,
                        extra={"func": "tools"})
            return False
        self._tools[tool.name] = tool
        self.enabled = True
        return True

    def list(self) -> list[Tool]:
        """The tools in order."""
        return list(self._tools.values())

    def get(self, name: str, stream: bool = False) -> Tool:
        """The tool named ``name``. Raises UnknownToolError ``unknown tool "NAME"``, or ``tool "NAME"
        does not support stream = true`` when ``stream`` and it cannot (llama-server's texts, 404)."""
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownToolError(f'unknown tool "{name}"')
        if stream and not tool.support_stream:
            raise UnknownToolError(f'tool "{name}" does not support stream = true')
        return tool

    def __len__(self) -> int:
        return len(self._tools)

    # -- the process groups tools started -------------------------------------------------
    def track(self, pgid: int) -> None:
        """Remember a process group a tool started (killed by :meth:`close`)."""
        self._groups.add(pgid)

    def untrack(self, pgid: int) -> None:
        self._groups.discard(pgid)

    def close(self) -> None:
        """Kill every process group still running (server stop)."""
        from kvserve.tools.runtime import kill_group

        for pgid in list(self._groups):
            kill_group(pgid)
        self._groups.clear()


def param(params: dict, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """``params[key]`` checked against ``kind`` (bool is not an int); missing -> ``default``, or
    ToolParamsError when there is none. Raises ToolParamsError on the wrong type."""
    if key not in params or params[key] is None:
        if default is ...:
            raise ToolParamsError(f"missing required param '{key}'")
        return default
    v = params[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:
        raise ToolParamsError(f"param '{key}' must be of type {kinds[0].__name__}")
    if int in kinds and isinstance(v, float) and not isinstance(v, bool) and v.is_integer():
        return int(v)
    if not isinstance(v, kinds):
        raise ToolParamsError(f"param '{key}' must be of type {kinds[0].__name__}")
    return v
