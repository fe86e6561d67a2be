"""The built-in tools, as llama-server's server-tools.cpp defines them (names, params, definitions,
answer fields and texts): ``read_file``, ``file_glob_search``, ``grep_search``,
``exec_shell_command``, ``write_file``, ``edit_file``, ``get_info``.

Each runs on the host (:class:`HostIO`, paths checked by :mod:`kvserve.tools.paths`) or in a running
container (:class:`ContainerIO`, every operation a command through ``ENGINE exec``). Where kvserve
differs from llama-server, it is stricter or bounded where llama-server is not:

* paths: relative ones stay inside the cwd (no ``..`` or symlink out), devices/FIFOs/sockets are
  refused (llama-server would hang on a FIFO and read ``/dev/zero`` forever);
* ``read_file`` with a line range stops reading at ``end_line`` and refuses files over 64 MiB
  (llama-server reads any size whole); ``grep_search`` skips files over 16 MiB and binary files
  (a NUL in the first 8 KiB), stops after 15 s, and its regular expression (Python's ``regex``, close
  to ECMAScript's) cannot run away: each search has a time limit;
* a glob ``**/`` also matches at the top level (``src/*.cpp`` finds ``src/a.cpp``; llama-server's
  matcher needs a ``/`` before ``src``);
* ``exec_shell_command`` runs in its own process group, killed whole at the end, on timeout and
  when the client goes away (:mod:`kvserve.tools.runtime`).
"""

from __future__ import annotations

import base64
import codecs
import functools
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.tools.base import BaseTool, ToolContext, ToolParamsError, param
from kvserve.tools import paths as P
from kvserve.tools.runtime import (
    ISOLATE_EXEC_TIMEOUT,
    ProcessResult,
    container_argv,
    in_thread,
    parse_runtime,
    run_process,
    stream_process,
)

READ_FILE_MAX_SIZE = 16 * 1024  # bytes answered without a line range (llama-server's)
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024  # x-resp-type: base64 (llama-server's)
READ_FILE_MAX_RANGE_SIZE = 64 * 1024 * 1024  # a file read by line range (kvserve's bound)
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100
GREP_MAX_FILE_SIZE = 16 * 1024 * 1024  # larger files are not searched (kvserve's bound)
GREP_MAX_OUTPUT = 1024 * 1024  # bytes of grep output at most (kvserve's bound)
EXEC_MAX_OUTPUT_SIZE = 16 * 1024
EXEC_MAX_TIMEOUT = 60
EXEC_DEFAULT_TIMEOUT = 10
LIST_TIMEOUT = 15.0  # seconds one listing may take (llama-server's)
LIST_MAX_ENTRIES = 200_000  # entries one listing keeps at most (kvserve's bound)
GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT = 5
#: directories a listing reports but never walks (llama-server's SERVER_TOOL_JUNK_DIR_NAMES)
JUNK_DIR_NAMES = frozenset({".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build",
                            "target", ".cache", ".idea", ".vscode"})


# -- glob ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _glob_regex(pattern: str):
    """llama-server's glob as a regular expression: ``*`` any run without ``/``, ``**`` anything,
    ``**/`` any leading directories (or none), ``?`` one character but ``/``, ``[...]`` a class
    (``!`` negates)."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] in "]-":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape("["))
                i += 1
                continue
            body = pattern[i + 1:j]
            neg = body.startswith("!")
            body = body[1:] if neg else body
            out.append("[" + ("^" if neg else "") + body.replace("\\", "\\\\").replace("^", "\\^").replace("[", "\\[")
                       + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    import regex

    return regex.compile("".join(out) + r"\Z", regex.S | regex.V0)


#: seconds one glob match may take (a pattern of many ``*`` backtracks)
GLOB_MATCH_TIMEOUT = 0.05


def glob_match(pattern: str, text: str) -> bool:
    """True when ``text`` matches the glob ``pattern`` whole (False for an invalid pattern or one
    that takes longer than :data:`GLOB_MATCH_TIMEOUT`)."""
    import regex

    try:
        return _glob_regex(pattern).match(text, timeout=GLOB_MATCH_TIMEOUT) is not None
    except (regex.error, TimeoutError):
        return False


def path_glob_match(pattern: str, rel: str) -> bool:
    """llama-server's rule: a pattern without ``/`` matches the basename at any depth; one with ``/``
    matches the whole relative path, prefixed with ``**/`` unless it starts with ``**`` or ``/``."""
    if "/" not in pattern:
        return glob_match(pattern, rel.rsplit("/", 1)[-1])
    if pattern == "**" or pattern.startswith("**/") or pattern.startswith("/"):
        return glob_match(pattern, rel)
    return glob_match("**/" + pattern, rel)


def _filter(entries: list[tuple[str, bool]], include: str, exclude: str) -> list[tuple[str, bool]]:
    """The entries ``include`` matches and ``exclude`` does not."""
    return [(rel, d) for rel, d in entries
            if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]


def _depth(rel: str) -> int:
    return 1 + rel.count("/")


# -- I/O: the host or a container --------------------------------------------------------------

@dataclass
class Listing:
    """A directory listing: ``entries`` ((relative '/'-path, is_dir), ...), ``err`` (set when the
    base is not a directory) and ``truncated`` (time, size or unreadable parts)."""

    entries: list[tuple[str, bool]] = field(default_factory=list)
    err: str = ""
    truncated: bool = False


class HostIO:
    """Tool I/O on this machine, in the call's cwd (paths checked by :mod:`kvserve.tools.paths`)."""

    def __init__(self, ctx: ToolContext, confine: bool = False, registry=None):
        self.ctx, self.confine, self.registry = ctx, confine, registry
        self.cwd = P.base_dir(ctx.cwd)

    def resolve(self, path: str) -> str:
        return P.resolve(path, self.ctx.cwd, self.confine)

    async def file_size(self, path: str) -> int | None:
        st = await in_thread(P.check_regular, path)
        return None if st is None else st.st_size

    async def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    async def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    async def read(self, path: str, max_bytes: int) -> bytes | None:
        """The file's bytes (at most ``max_bytes``); None when it cannot be opened."""
        def read() -> bytes | None:
            try:
                fd = P.open_regular(path)
            except OSError:
                return None
            with os.fdopen(fd, "rb") as f:
                return f.read(max_bytes)
        return await in_thread(read)

    async def read_lines(self, path: str, start: int, end: int, max_bytes: int) -> list[bytes] | None:
        """Lines ``start``..``end`` (1-based, inclusive; -1: to the end), each without its newline,
        reading no further than needed and at most ``max_bytes`` in all (a last None: the cap was
        reached there)."""
        def read() -> list[bytes] | None:
            try:
                fd = P.open_regular(path)
            except OSError:
                return None
            out, seen, n = [], 0, 0
            with os.fdopen(fd, "rb") as f:
                while True:
                    line = f.readline(max_bytes - seen + 1)  # a file of one huge line stays bounded too
                    n += 1
                    seen += len(line)
                    if seen > max_bytes:
                        out.append(None)  # stopped at the read cap
                        break
                    if not line or (end != -1 and n > end) or not self.ctx.alive():
                        break
                    if n >= start:
                        out.append(line[:-1] if line.endswith(b"\n") else line)
            return out
        return await in_thread(read)

    async def write(self, path: str, data: bytes) -> bool:
        def write() -> bool:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                fd = P.open_regular(path, write=True)
            except OSError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.truncate(0)
                f.write(data)
            return True
        return await in_thread(write)

    async def run(self, argv: list[str], timeout_s: float, max_output: int, stream: bool = False,
                  result: ProcessResult | None = None):
        if stream:
            return stream_process(argv, self.ctx, timeout_s, max_output, cwd=self.cwd, registry=self.registry,
                                  result=result)
        return await run_process(argv, self.ctx, timeout_s, max_output, cwd=self.cwd, registry=self.registry)

    def shell_argv(self, command: str, timeout_s: int) -> list[str]:
        return ["sh", "-c", command]

    def allowed(self, path: str) -> bool:
        """True when a listed file may be read (a symlink inside the cwd pointing out may not)."""
        try:
            P.resolve(path, self.ctx.cwd, self.confine)
            return True
        except P.PathRefused:
            return False

    async def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        if not os.path.isdir(base):
            return Listing(err="path does not exist or is not a directory")
        deadline = time.monotonic() + min(LIST_TIMEOUT, max(0.0, self.ctx.remaining()))
        if kind == "file":
            res = await run_process(["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                                    self.ctx, LIST_TIMEOUT, GIT_LS_FILES_MAX_OUTPUT, registry=self.registry)
            if res.exit_code == 0 and not res.timed_out and not res.cancelled and "[output truncated]" not in \
                    res.output[-20:]:
                def keep() -> list[tuple[str, bool]]:
                    out = []
                    for line in res.raw.decode("utf-8", "replace").splitlines():
                        line = line.rstrip("\r").replace("\\", "/")
                        if not line or (max_depth > 0 and _depth(line) > max_depth):
                            continue
                        if os.path.isfile(os.path.join(base, line)):
                            out.append((line, False))
                    return out
                return Listing(entries=await in_thread(keep))
        return await in_thread(self._walk, base, max_depth, kind, deadline)

    def _walk(self, base: str, max_depth: int, kind: str, deadline: float) -> Listing:
        out = Listing()
        stack = [(base, "", 0)]
        while stack:
            if time.monotonic() >= deadline or not self.ctx.alive() or len(out.entries) >= LIST_MAX_ENTRIES:
                out.truncated = True
                return out
            d, rel_dir, depth = stack.pop()
            try:
                it = list(os.scandir(d))
            except OSError:
                out.truncated = True
                continue
            for e in it:
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                try:
                    is_dir = e.is_dir()
                except OSError:
                    continue
                if is_dir:
                    if kind in ("dir", "all"):
                        out.entries.append((rel, True))
                    if e.name.lower() in JUNK_DIR_NAMES:
                        continue
                    if not e.is_symlink() and (max_depth == 0 or depth + 1 < max_depth):
                        stack.append((e.path, rel, depth + 1))
                else:
                    try:
                        regular = e.is_file()
                    except OSError:
                        continue
                    if regular and kind in ("file", "all"):
                        out.entries.append((rel, False))
        return out


class ContainerIO:
    """Tool I/O inside a running container: every operation is a command through ``ENGINE exec``
    (:func:`kvserve.tools.runtime.container_argv`); paths are POSIX, joined to the cwd."""

    def __init__(self, ctx: ToolContext, registry=None):
        self.ctx, self.registry = ctx, registry
        self.rt = parse_runtime(ctx.runtime)
        self.cwd = ctx.cwd or ""

    def resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise P.PathRefused("path must be a non-empty string without NUL bytes")
        if path.startswith("/") or not self.cwd:
            return path
        return self.cwd.rstrip("/") + "/" + path

    def allowed(self, path: str) -> bool:
        return True

    async def _exec(self, inner: list[str], max_output: int, stdin: bytes | None = None) -> ProcessResult:
        return await run_process(container_argv(self.rt, inner, stdin=stdin is not None), self.ctx,
                                 ISOLATE_EXEC_TIMEOUT, max_output, stdin=stdin, registry=self.registry)

    async def _test(self, flag: str, path: str) -> bool:
        r = await self._exec(["sh", "-c", f'[ {flag} "$1" ]', "_", path], 4096)
        return r.exit_code == 0 and not r.timed_out

    async def is_dir(self, path: str) -> bool:
        return await self._test("-d", path)

    async def is_file(self, path: str) -> bool:
        return await self._test("-f", path)

    async def file_size(self, path: str) -> int | None:
        if not await self._test("-f", path):
            return None
        r = await self._exec(["sh", "-c", 'wc -c < "$1"', "_", path], 64)
        try:
            return int(r.output.strip()) if r.exit_code == 0 else None
        except ValueError:
            return None

    async def read(self, path: str, max_bytes: int) -> bytes | None:
        r = await self._exec(["cat", "--", path], max_bytes)
        return r.raw if r.exit_code == 0 and not r.timed_out else None

    async def read_lines(self, path: str, start: int, end: int, max_bytes: int) -> list[bytes] | None:
        data = await self.read(path, max_bytes)
        if data is None:
            return None
        lines = _split_lines(data)
        return lines[start - 1:] if end == -1 else lines[start - 1:end]

    async def write(self, path: str, data: bytes) -> bool:
        r = await self._exec(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "_", path], 4096, stdin=data)
        return r.exit_code == 0 and not r.timed_out

    async def run(self, argv: list[str], timeout_s: float, max_output: int, stream: bool = False,
                  result: ProcessResult | None = None):
        # killing the host-side client does not kill the command inside: an in-container timeout does
        full = container_argv(self.rt, argv, stdin=True, cwd=self.cwd or None)
        if stream:
            return stream_process(full, self.ctx, timeout_s + 5, max_output, registry=self.registry, result=result)
        return await run_process(full, self.ctx, timeout_s + 5, max_output, registry=self.registry)

    def shell_argv(self, command: str, timeout_s: int) -> list[str]:
        return ["timeout", f"{int(timeout_s)}s", "sh", "-c", command]

    async def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        if not await self.is_dir(base):
            return Listing(err="path does not exist or is not a directory")
        if kind == "file":
            r = await self._exec(["sh", "-c", 'cd "$1" && git ls-files --cached --others --exclude-standard', "_",
                                  base], GIT_LS_FILES_MAX_OUTPUT)
            if r.exit_code == 0 and not r.timed_out:
                rels = [ln.rstrip("\r") for ln in r.raw.decode("utf-8", "replace").splitlines() if ln.strip()]
                return Listing(entries=[(x, False) for x in rels if not (max_depth > 0 and _depth(x) > max_depth)])
        out = Listing()
        prune = " -o ".join(f"-name {n}" for n in sorted(JUNK_DIR_NAMES))
        for dirs in ((True,) if kind == "dir" else (False,) if kind == "file" else (True, False)):
            cmd = 'cd "$1" && find . -mindepth 1' + (f" -maxdepth {int(max_depth)}" if max_depth > 0 else "")
            cmd += f" \\( {prune} \\) -prune" + (" -print -o -type d -print" if dirs else " -o -type f -print")
            r = await self._exec(["sh", "-c", cmd, "_", base], GIT_LS_FILES_MAX_OUTPUT)
            out.truncated |= r.timed_out
            for ln in r.raw.decode("utf-8", "replace").splitlines():
                ln = ln.rstrip("\r")
                if ln:
                    out.entries.append((ln[2:] if ln.startswith("./") else ln, dirs))
        return out


def make_io(ctx: ToolContext, confine: bool = False, registry=None) -> HostIO | ContainerIO:
    """The call's I/O: a container when ``ctx.runtime`` names one, else the host."""
    return ContainerIO(ctx, registry) if ctx.runtime else HostIO(ctx, confine, registry)


def _split_lines(data: bytes) -> list[bytes]:
    """std::getline's lines: split at ``\\n``; a last empty piece (a final newline) is no line."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


# -- the tools ---------------------------------------------------------------------------------

class _Builtin(BaseTool):
    """A built-in tool; ``self.registry`` (set by the registry's owner) tracks its process groups."""

    uses_cwd = True
    description = ""
    properties: dict = {}
    required: tuple[str, ...] = ()

    def __init__(self, confine: bool = False, registry=None):
        self.confine, self.registry = confine, registry

    def definition(self) -> dict:
        params: dict = {"type": "object", "properties": self.properties}
        if self.required:
            params["required"] = list(self.required)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}

    def io(self, ctx: ToolContext):
        return make_io(ctx, self.confine, self.registry)

    async def sized(self, ctx: ToolContext, path: str):
        """``(io, resolved path, size in bytes or None when it cannot be stat'ed)`` of the caller's
        ``path`` in ``ctx``'s runtime. Raises P.PathRefused: the path may not be used."""
        io = self.io(ctx)
        full = io.resolve(path)
        return io, full, await io.file_size(full)


def _prop(t: str, d: str) -> dict:
    return {"type": t, "description": d}


class ReadFile(_Builtin):
    name, display_name = "read_file", "Read file"
    description = ("Read the contents of a file. Optionally specify a 1-based line range. "
                   "If append_loc is true, each line is prefixed with its line number (e.g. \"1\u2192...\").")
    properties = {"path": _prop("string", "Path to the file"),
                  "start_line": _prop("integer", "First line to read, 1-based (default: 1)"),
                  "end_line": _prop("integer", "Last line to read, 1-based inclusive (default: end of file)"),
                  "append_loc": _prop("boolean", "Prefix each line with its line number")}
    required = ("path",)

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        path = param(params, "path", str)
        start = param(params, "start_line", int, 1)
        end = param(params, "end_line", int, -1)
        append_loc = param(params, "append_loc", bool, False)
        try:
            io, full, size = await self.sized(ctx, path)
        except P.PathRefused as e:
            return {"error": e.message}
        if size is None:
            return {"error": f"cannot stat file: {path}"}
        if ctx.resp_type == "base64":
            if size > READ_FILE_MAX_SIZE_BASE64:
                return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE_BASE64})"}
            data = await io.read(full, READ_FILE_MAX_SIZE_BASE64)
            if data is None:
                return {"error": f"failed to open file: {path}"}
            return {"base64": base64.b64encode(data).decode(), "size_bytes": len(data)}
        if size > READ_FILE_MAX_SIZE and end == -1:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                             "Use start_line/end_line to read a portion."}
        lines = await io.read_lines(full, max(1, start), end, READ_FILE_MAX_RANGE_SIZE)
        if lines is None:
            return {"error": f"failed to open file: {path}"}
        out, used = [], 0
        first = max(1, start)
        for i, raw in enumerate(lines):
            if raw is None:  # the read stopped at its cap
                out.append("[output truncated]")
                break
            line = (f"{first + i}\u2192" if append_loc else "") + _text(raw) + "\n"
            n = len(line.encode())
            if used + n > READ_FILE_MAX_SIZE:
                out.append("[output truncated]")
                break
            out.append(line)
            used += n
        return {"plain_text_response": "".join(out)}


class FileGlobSearch(_Builtin):
    name, display_name = "file_glob_search", "File search"
    description = (
        "Recursively search for files matching a glob pattern under a directory. "
        "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
        "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
        "A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. "
        "A pattern containing '/' matches the full relative path; unless already anchored with "
        "\"**/\" or a leading '/', it is automatically prefixed with \"**/\". "
        "Use type=\"dir\" or \"all\" to also list directories; directory entries are suffixed with '/' in the output. "
        "Note: directory listings do not apply .gitignore filtering.")
    properties = {
        "path": _prop("string", "Base directory to search in"),
        "include": _prop("string", "Glob pattern for files to include (e.g. \"*.cpp\" or \"src/**/*.cpp\"). "
                                   "Default: **"),
        "exclude": _prop("string", "Glob pattern for files to exclude"),
        "type": _prop("string", "Entry type to return: \"file\" (default), \"dir\" or \"all\""),
        "max_depth": _prop("integer", "Maximum depth to descend into subdirectories (default: 0 = unlimited; "
                                      "1 = direct children only)"),
        "limit": _prop("integer", f"Maximum number of results to return, capped at {FILE_SEARCH_MAX_RESULTS} "
                                  f"(default {FILE_SEARCH_MAX_RESULTS})"),
    }
    required = ("path",)

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        path = param(params, "path", str)
        include = param(params, "include", str, "**")
        exclude = param(params, "exclude", str, "")
        kind = param(params, "type", str, "file")
        max_depth = max(0, param(params, "max_depth", int, 0))
        limit_req = param(params, "limit", int, FILE_SEARCH_MAX_RESULTS)
        if limit_req < 1:
            return {"error": f"invalid limit: {limit_req} (expected 1 or more)"}
        limit = min(limit_req, FILE_SEARCH_MAX_RESULTS)
        if kind not in ("file", "dir", "all"):
            return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
        io = self.io(ctx)
        try:
            base = io.resolve(path)
        except P.PathRefused as e:
            return {"error": e.message}
        listing = await io.list_entries(base, max_depth, kind)
        if listing.err:
            return {"error": f"{listing.err}: {path}"}
        matches = await in_thread(_filter, listing.entries, include, exclude)
        total, shown = len(matches), min(len(matches), limit)
        text = "".join(f"{rel}{'/' if d else ''}\n" for rel, d in matches[:shown])
        text += f"\n---\nTotal matches: {total}\n"
        if total > shown:
            text += (f"[{shown} results limit reached ({total} total matches). "
                     "Refine the glob pattern to narrow the search.]\n")
        if listing.truncated:
            text += "[results truncated: time budget or unreadable directory]\n"
        return {"plain_text_response": text,
                "entries": [{"path": rel, "type": "dir" if d else "file"} for rel, d in matches[:shown]],
                "base": base}


class GrepSearch(_Builtin):
    name, display_name = "grep_search", "Grep search"
    description = (
        "Search for a pattern in files under a path. Returns matching lines with file paths "
        "(and, unless searching a single file, paths relative to the given directory). "
        "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
        "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
        "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern "
        "containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored).")
    properties = {
        "path": _prop("string", "File or directory to search in"),
        "pattern": _prop("string", "Pattern to search for (regular expression unless literal is true)"),
        "include": _prop("string", "Glob pattern to filter files (default: **)"),
        "exclude": _prop("string", "Glob pattern to exclude files"),
        "return_line_numbers": _prop("boolean", "If true, include line numbers in results"),
        "literal": _prop("boolean", "Treat pattern as a literal string instead of a regular expression "
                                    "(default: false)"),
        "ignore_case": _prop("boolean", "Case-insensitive search (default: false)"),
        "context_lines": _prop("integer", "Number of lines of context to show before and after each match "
                                          "(default: 0)"),
    }
    required = ("path", "pattern")

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        import regex

        path = param(params, "path", str)
        pat = param(params, "pattern", str)
        include = param(params, "include", str, "**")
        exclude = param(params, "exclude", str, "")
        show_num = param(params, "return_line_numbers", bool, False)
        literal = param(params, "literal", bool, False)
        ignore_case = param(params, "ignore_case", bool, False)
        ctx_lines = min(max(0, param(params, "context_lines", int, 0)), 1000)
        try:
            rx = regex.compile(regex.escape(pat) if literal else pat, regex.IGNORECASE if ignore_case else 0)
        except (regex.error, RecursionError, OverflowError) as e:
            return {"error": f"invalid regex: {e}"}
        io = self.io(ctx)
        try:
            abs_path = io.resolve(path)
        except P.PathRefused as e:
            return {"error": e.message}
        files: list[tuple[str, str]] = []
        if await io.is_file(abs_path):
            files.append((abs_path, path))
        elif await io.is_dir(abs_path):
            listing = await io.list_entries(abs_path, 0, "file")
            if listing.err:
                return {"error": f"{listing.err}: {path}"}
            for rel, _ in await in_thread(_filter, listing.entries, include, exclude):
                files.append((abs_path.rstrip("/") + "/" + rel, rel))
        else:
            return {"error": f"path does not exist: {path}"}
        deadline = time.monotonic() + min(LIST_TIMEOUT, max(0.0, ctx.remaining()))
        out: list[str] = []
        size = 0
        total = 0
        limit_reached = stopped = False
        show = show_num or ctx_lines > 0
        for fpath, display in files:
            if limit_reached or stopped:
                break
            if time.monotonic() >= deadline or not ctx.alive():
                stopped = True
                break
            if not io.allowed(fpath):
                continue
            data = await io.read(fpath, GREP_MAX_FILE_SIZE + 1)
            if data is None or len(data) > GREP_MAX_FILE_SIZE or b"\x00" in data[:8192]:
                continue
            lines = [_text(x) for x in _split_lines(data)]
            pieces, found, limit_reached, stop = await in_thread(
                _grep_lines, rx, lines, display, GREP_SEARCH_MAX_RESULTS - total, ctx_lines, show, deadline,
                GREP_MAX_OUTPUT - size)
            out += pieces
            size += sum(len(x) for x in pieces)
            total += found
            stopped = stopped or stop
        text = "".join(out)
        if len(text) > GREP_MAX_OUTPUT:
            text = text[:GREP_MAX_OUTPUT] + "[output truncated]\n"
        text += f"\n---\nTotal matches: {total}\n"
        if limit_reached:
            text += (f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. "
                     "Narrow the path/pattern/include to see more.]\n")
        if stopped:
            text += "[search stopped: time or output limit reached. Narrow the path/pattern/include.]\n"
        return {"plain_text_response": text}


def _grep_lines(rx, lines: list[str], display: str, room: int, ctx_lines: int, show: bool, deadline: float,
                max_size: int) -> tuple[list[str], int, bool, bool]:
    """One file's matches (run in a worker thread: ``regex`` releases the GIL): ``(output pieces,
    matches, the match limit reached, stopped by time or size)``; at most ``room`` matches, each
    search limited to the time left before ``deadline``."""
    out: list[str] = []
    size = found = 0
    for i, line in enumerate(lines):
        if found >= room:
            return out, found, True, False
        left = deadline - time.monotonic()
        if left <= 0:
            return out, found, False, True
        try:
            if not rx.search(line, timeout=left, concurrent=True):
                continue
        except TimeoutError:
            return out, found, False, True
        lo, hi = (max(0, i - ctx_lines), min(len(lines) - 1, i + ctx_lines)) if ctx_lines else (i, i)
        for j in range(lo, hi + 1):
            sep = ":" if j == i else "-"
            piece = f"{display}{sep}" + (f"{j + 1}{sep}" if show else "") + lines[j] + "\n"
            out.append(piece)
            size += len(piece)
        if ctx_lines:
            out.append("--\n")
        found += 1
        if size > max_size:
            return out, found, False, True
    return out, found, False, False


class ExecShellCommand(_Builtin):
    name, display_name = "exec_shell_command", "Execute shell command"
    permission_write = True
    support_stream = True
    description = "Execute a shell command and return its output (stdout and stderr combined)."
    properties = {
        "command": _prop("string", "Shell command to execute"),
        "timeout": _prop("integer", f"Timeout in seconds (default {EXEC_DEFAULT_TIMEOUT}, max {EXEC_MAX_TIMEOUT})"),
        "max_output_size": _prop("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT_SIZE})"),
    }
    required = ("command",)

    def _args(self, params: dict, ctx: ToolContext):
        command = param(params, "command", str)
        timeout = min(max(1, param(params, "timeout", int, EXEC_DEFAULT_TIMEOUT)), EXEC_MAX_TIMEOUT)
        max_output = min(max(0, param(params, "max_output_size", int, EXEC_MAX_OUTPUT_SIZE)), EXEC_MAX_OUTPUT_SIZE)
        io = self.io(ctx)
        return io, io.shell_argv(command, timeout), timeout, max_output

    @staticmethod
    def _tail(res: ProcessResult) -> str:
        return f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        io, argv, timeout, max_output = self._args(params, ctx)
        res = await io.run(argv, timeout, max_output)
        return {"plain_text_response": res.output + self._tail(res)}

    async def stream(self, params: dict, ctx: ToolContext) -> AsyncIterator[str]:
        io, argv, timeout, max_output = self._args(params, ctx)
        res = ProcessResult("", -1)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        chunks = await io.run(argv, timeout, max_output, stream=True, result=res)
        try:
            async for data in chunks:
                text = decoder.decode(data)
                if text:
                    yield text
        finally:
            await chunks.aclose()
        if res.cancelled:
            return
        tail = decoder.decode(b"", final=True)
        if "[output truncated]" in res.output[-20:]:
            tail += "\n[output truncated]"
        yield tail + self._tail(res)


class WriteFile(_Builtin):
    name, display_name = "write_file", "Write file"
    permission_write = True
    description = ("Write content to a file, creating it (including parent directories) if it does not exist. "
                   "May use with edit_file for more complex edits.")
    properties = {"path": _prop("string", "Path of the file to write"),
                  "content": _prop("string", "Content to write")}
    required = ("path", "content")

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        path = param(params, "path", str)
        content = param(params, "content", str).encode()
        io = self.io(ctx)
        try:
            full = io.resolve(path)
            if isinstance(io, HostIO):
                await in_thread(P.check_regular, full)
        except P.PathRefused as e:
            return {"error": e.message}
        if not await io.write(full, content):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file written successfully", "path": path, "bytes": len(content)}


class EditFile(_Builtin):
    name, display_name = "edit_file", "Edit file"
    permission_write = True
    description = ("Edit a file using exact text replacement. Each edits[].old_text must be unique in the file "
                   "and is matched against the original content, not incrementally. Merge nearby changes into "
                   "one edit instead of overlapping edits. Use write_file to replace the whole file.")
    properties = {
        "path": _prop("string", "Path to the file to edit"),
        "edits": {"type": "array", "description": "One or more exact text replacements to apply",
                  "items": {"type": "object", "properties": {
                      "old_text": _prop("string", "Exact text to find; must be unique in the file and must not "
                                                  "overlap with other edits"),
                      "new_text": _prop("string", "Text to replace old_text with")},
                      "required": ["old_text", "new_text"]}},
    }
    required = ("path", "edits")

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        path = param(params, "path", str)
        edits_json = params.get("edits")
        if not isinstance(edits_json, list) or not edits_json:
            return {"error": "\"edits\" must be a non-empty array"}
        edits: list[tuple[str, str]] = []
        for i, e in enumerate(edits_json):
            if not isinstance(e, dict):
                raise ToolParamsError(f"edits[{i}] must be an object")
            old, new = param(e, "old_text", str), param(e, "new_text", str)
            if not old:
                return {"error": f"edits[{i}].old_text must not be empty"}
            edits.append((old, new))
        try:
            io, full, size = await self.sized(ctx, path)
        except P.PathRefused as e:
            return {"error": e.message}
        data = await io.read(full, READ_FILE_MAX_RANGE_SIZE + 1) if size is not None else None
        if data is None:
            return {"error": f"failed to open file: {path}"}
        if len(data) > READ_FILE_MAX_RANGE_SIZE:
            return {"error": f"file too large ({len(data)} bytes, max {READ_FILE_MAX_RANGE_SIZE})"}
        original = _text(data)
        new_content, err = apply_edits(original, edits, path)
        if err:
            return {"error": err}
        if not await io.write(full, new_content.encode()):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file edited successfully", "path": path, "edits_applied": len(edits)}


class GetInfo(_Builtin):
    name, display_name = "get_info", "Get Runtime Info"
    description = "Returns runtime info: the OS name/version and the current working directory"
    properties = {}

    def definition(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": {}}}}

    async def run(self, params: dict, ctx: ToolContext) -> dict:
        io = self.io(ctx)
        res = await io.run(["uname", "-a"], GET_INFO_TIMEOUT, GET_INFO_MAX_OUTPUT)
        os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
        cwd = ctx.cwd or ""
        if not cwd:
            if not ctx.runtime:
                cwd = os.getcwd()
            else:
                pwd = await io.run(["pwd"], GET_INFO_TIMEOUT, GET_INFO_MAX_OUTPUT)
                cwd = pwd.output.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
        return {"os": os_info, "cwd": cwd}


# -- edit_file's matching (llama-server's, fuzzy whitespace/quote normalisation included) ----------

_FUZZY = [("\u2018", "'"), ("\u2019", "'"), ("\u201a", "'"), ("\u201b", "'"),
          ("\u201c", '"'), ("\u201d", '"'), ("\u201e", '"'), ("\u201f", '"'),
          *((chr(c), "-") for c in range(0x2010, 0x2016)), ("\u2212", "-"), ("\u00a0", " "),
          *((chr(c), " ") for c in range(0x2002, 0x200b)), ("\u202f", " "), ("\u205f", " "), ("\u3000", " ")]
_FUZZY_TABLE = str.maketrans(dict(_FUZZY))


def normalize_for_fuzzy_match(text: str) -> str:
    """Each line without trailing spaces/tabs/CRs, smart quotes, dashes and special spaces made ASCII
    (line count and positions kept)."""
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY_TABLE) for line in text.split("\n"))


def _count(content: str, needle: str) -> int:
    n = pos = 0
    while needle:
        pos = content.find(needle, pos)
        if pos < 0:
            break
        n += 1
        pos += len(needle)
    return n


def apply_edits(original: str, edits: list[tuple[str, str]], path: str) -> tuple[str, str | None]:
    """``(new content, None)`` or ``("", error text)``: llama-server's edit_file rules (each old text
    found exactly once, fuzzy-normalized if not found as is; edits must not overlap; a no-op refused)."""
    any_fuzzy = False
    norm_original = normalize_for_fuzzy_match(original)
    for i, (old, _) in enumerate(edits):
        if old in original:
            continue
        if normalize_for_fuzzy_match(old) not in norm_original:
            return "", (f"could not find edits[{i}].old_text in {path}, it must match the file's current content "
                        "exactly")
        any_fuzzy = True
    base = norm_original if any_fuzzy else original
    matched = []
    for i, (old, new) in enumerate(edits):
        needle = normalize_for_fuzzy_match(old) if any_fuzzy else old
        occurrences = _count(norm_original, normalize_for_fuzzy_match(old))
        if occurrences > 1:
            return "", f"found {occurrences} occurrences of edits[{i}].old_text in {path}, it must be unique"
        matched.append((base.find(needle), len(needle), i, new))
    matched.sort()
    for a, b in zip(matched, matched[1:]):
        if a[0] + a[1] > b[0]:
            return "", (f"edits[{a[2]}] and edits[{b[2]}] overlap in {path}; merge them into one edit or target "
                        "disjoint regions")
    if any_fuzzy:
        new_content = _apply_preserving_lines(original, base, matched)
    else:
        new_content = _apply(base, matched, 0)
    if new_content == original:
        return "", "no changes made: the replacement(s) produced identical content"
    return new_content, None


def _apply(content: str, reps, offset: int) -> str:
    for idx, length, _, new in reversed(reps):
        k = idx - offset
        content = content[:k] + new + content[k + length:]
    return content


def _split_keep(text: str) -> list[str]:
    out, start = [], 0
    while start < len(text):
        nl = text.find("\n", start)
        if nl < 0:
            out.append(text[start:])
            break
        out.append(text[start:nl + 1])
        start = nl + 1
    return out


def _apply_preserving_lines(original: str, base: str, reps) -> str:
    """Apply ``reps`` (on the normalized ``base``) so that untouched lines keep the original's text."""
    orig_lines = _split_keep(original)
    spans, off = [], 0
    for line in _split_keep(base):
        spans.append((off, off + len(line)))
        off += len(line)
    groups: list[list] = []  # [start_line, end_line (exclusive), reps]
    for rep in reps:
        start_i = next((k for k, (s, e) in enumerate(spans) if s <= rep[0] < e), None)
        if start_i is None:
            start_i = end_i = max(0, len(spans) - 1)
        else:
            end_i = start_i
            while end_i < len(spans) and spans[end_i][1] < rep[0] + rep[1]:
                end_i += 1
            end_i = min(end_i, len(spans) - 1)
        if groups and start_i < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], end_i + 1)
            groups[-1][2].append(rep)
        else:
            groups.append([start_i, end_i + 1, [rep]])
    out, k = [], 0
    for g_start, g_end, g_reps in groups:
        out.extend(orig_lines[k:g_start])
        s, e = spans[g_start][0], spans[g_end - 1][1]
        out.append(_apply(base[s:e], g_reps, s))
        k = g_end
    out.extend(orig_lines[k:])
    return "".join(out)


def builtin_tools(confine: bool = False, registry=None) -> list[_Builtin]:
    """Every built-in tool, in llama-server's order."""
    return [cls(confine, registry) for cls in (ReadFile, FileGlobSearch, GrepSearch, ExecShellCommand, WriteFile,
                                               EditFile, GetInfo)]
