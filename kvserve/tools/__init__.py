"""Server tools (llama-server's ``--tools``, ``/tools``; issue 36): tools a caller (llama-server's web
page, an agent) asks the server to run: the built-in file and shell tools and, added by
:mod:`kvserve.mcp` at warm-up, the tools of configured MCP servers.

The interface (stable: the MCP servers and the chat page build on it):

* :class:`ToolContext`: where and how long one call runs: ``cwd`` (``x-tool-cwd``), ``runtime``
  (``x-tool-runtime`` / ``--tools-runtime``: ``docker-container:ID``, ``podman-container:ID``),
  ``resp_type`` (``x-resp-type``), ``timeout_s``, and ``cancelled`` (an ``asyncio.Event`` set when the
  client is gone, the server stops or the time is up). Set from the operator's flags and the caller's
  headers only: a ``cwd``/``runtime``/``resp_type`` in the params is dropped, as llama-server does.
* :class:`Tool` (protocol; :class:`BaseTool` gives the common fields and :meth:`~Tool.entry`):
  ``name``, ``display_name``, ``type`` (``"server"`` | ``"mcp"``), ``permission_write``,
  ``support_stream``, ``uses_cwd``; ``definition()`` (the OpenAI function tool), ``entry()`` (its
  ``GET /tools`` element), ``async run(params, ctx) -> dict`` (the answer body) and, for a streaming
  tool, ``stream(params, ctx)`` (an async iterator of text chunks).
* :class:`ToolRegistry`: ``add(tool)``, ``list()``, ``get(name, stream=False)``; built at start by
  :meth:`ToolRegistry.from_names` from ``--tools`` (names, or ``all``) and ``--tools-runtime``; kept
  as ``ServerState.tools``. An MCP client adds its tools with :meth:`ToolRegistry.add` (which
  enables the routes; a name already taken is skipped with a warning).
* Errors: :class:`ToolError` and its kinds :class:`UnknownToolError` (404),
  :class:`ToolParamsError` (400), :class:`ToolRuntimeError` (500), each with llama-server's text.

The routes (:mod:`kvserve.faces.tools_api`, llama-server's shapes):

* ``GET /tools`` -> ``[{"display_name", "tool", "type", "permissions": {"write"}, "uses_cwd",
  "definition"}, ...]``;
* ``POST /tools`` ``{"tool": NAME, "params": {...}, "stream": false}`` -> 200 with the tool's answer:
  ``{"plain_text_response": TEXT, ...}``, ``{"result": ..., ...}`` or ``{"error": TEXT}``; with
  ``"stream": true``, ``text/event-stream`` events ``data: {"chunk": TEXT}`` then ``data: {"done":
  true}`` (``{"done": true, "error": TEXT}`` when the tool failed mid-way);
* both 403 ``{"error": {"message": "this feature is disabled", "type": "feature_disabled"}}`` unless
  ``--tools`` (or an MCP server) enabled them.

Security (this runs commands on the machine): see :mod:`kvserve.tools.paths` (every path stays in
the caller's cwd: ``..`` and symlinks out of it, device files and FIFOs are refused) and
:mod:`kvserve.tools.runtime` (a command runs in its own process group, killed with its request:
client gone, timeout or server stop; output is capped in bytes; a container id or engine never
reaches the engine's command line as an option). The routes sit behind ``--api-key`` and behind the
local-origin and DNS-rebinding rules of Ollama's ``/api`` routes (:mod:`kvserve.faces.auth`).
"""

from kvserve.tools.base import (
    BUILTIN_NAMES,
    BaseTool,
    Tool,
    ToolContext,
    ToolError,
    ToolParamsError,
    ToolRegistry,
    ToolRuntimeError,
    UnknownToolError,
)

__all__ = ["BUILTIN_NAMES", "BaseTool", "Tool", "ToolContext", "ToolError", "ToolParamsError", "ToolRegistry",
           "ToolRuntimeError", "UnknownToolError"]
