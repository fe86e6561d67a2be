"""The Modelfile form of a supervised engine, and where such models are kept.

A Modelfile with one ``ENGINE`` line makes ``kvserve create NAME -f Modelfile`` define a model
served by that engine::

    FROM /models/Qwen3-8B-4bit
    ENGINE mlx_lm.server --model {model} --host {host} --port {port}

- ``FROM`` keeps Ollama's meaning: where the weights are (a path, relative to the Modelfile, or a
  model in the store); ``{model}`` in the command becomes its absolute path (a store model's blob).
- ``ENGINE`` is kvserve's own command (Ollama's parser has no such command and refuses the file,
  so it means nothing else anywhere). The rest of the line is the command, as ``--engine`` takes it
  (``{port}`` required). No other command is allowed beside FROM: the engine applies its own
  template and defaults.

Where it is kept: ``<store>/kvserve/engines/<name>.json`` ({"name", "argv", "model"}), written only
by ``kvserve create`` in this process, never by the server's ``/api/create`` (an ``ENGINE`` line
there is refused by Ollama's grammar: a request body never starts a process), never pulled or
pushed (it is not a manifest or a blob). ``kvserve serve`` finds these models by name
(:func:`find_engine`) beside ``--engine``'s; ``kvserve rm NAME`` deletes the file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from pathlib import Path
from urllib.parse import quote

from kvserve.errors import InvalidInputError
from kvserve.supervisor.spec import EngineSpec, shown_command

__all__ = ["ENGINES_DIR", "create_engine_model", "engine_files", "engine_modelfile", "engine_modified", "find_engine",
           "remove_engine", "split_engine"]

#: under the store's root
ENGINES_DIR = Path("kvserve") / "engines"
#: a definition file larger than this is not read (bytes)
MAX_FILE_BYTES = 64 << 10

_ENGINE = re.compile(r"^[ \t]*ENGINE(?:[ \t]+(.*?))?[ \t]*$", re.IGNORECASE)


def split_engine(text: str) -> tuple[str | None, int, str]:
    """``(the ENGINE command or None, its line number, the Modelfile with that line blanked)``.

    Raises:
        InvalidInputError: more than one ENGINE line, or one without a command.
    """
    found: list[tuple[int, str]] = []
    kept: list[str] = []
    for i, line in enumerate(text.splitlines(), 1):
        m = _ENGINE.match(line)
        if m is None:
            kept.append(line)
            continue
        if not m.group(1):
            raise InvalidInputError(f"(line {i}): ENGINE needs a command, e.g. ENGINE llama-server -m {{model}} "
                                    "--port {port}")
        found.append((i, m.group(1)))
        kept.append("")  # the other lines keep their numbers
    if len(found) > 1:
        raise InvalidInputError(f"(line {found[1][0]}): only one ENGINE line is allowed")
    if not found:
        return None, 0, text
    return found[0][1], found[0][0], "\n".join(kept) + "\n"


def _file(store_root: Path, name: str) -> Path:
    return store_root / ENGINES_DIR / (quote(name, safe="") + ".json")


def create_engine_model(store_root: str | os.PathLike, name: str, text: str, base_dir: str | os.PathLike,
                        models_dir: str | os.PathLike | None = None) -> EngineSpec:
    """``kvserve create NAME`` for a Modelfile with an ENGINE line: check it and write the
    definition (atomically; an existing one of that name is replaced).

    Args:
        store_root: the store's root directory. name: the model's display name (``qwen:latest``).
        text: the Modelfile. base_dir: its directory (FROM paths are relative to it).

    Raises:
        InvalidInputError: no ENGINE line, no FROM, a command without ``{port}``, other commands.
        NotFoundError: FROM names a path or model that is not there.
    """
    from kvserve.ollama.modelfile import parse_modelfile, resolve_from

    cmd, line, rest = split_engine(text)
    if cmd is None:
        raise InvalidInputError("no ENGINE line")
    mf = parse_modelfile(rest)
    others = [c for c in mf.commands if c.name != "model"] + [c for c in mf.commands if c.name == "model"][1:]
    if others:
        c = others[0]
        raise InvalidInputError(f"(line {c.line}): a model served by an ENGINE takes one FROM and the ENGINE line "
                                f"only (the engine applies its own template and defaults)")
    src = resolve_from(mf.from_, base_dir, mf.line_of("model"))
    if src.kind in ("gguf", "directory"):
        model = src.path
    else:
        from kvserve.store import resolve_model

        model = str(resolve_model(mf.from_, models_dir=models_dir))
    try:
        argv = tuple(shlex.split(cmd))
    except ValueError as e:
        raise InvalidInputError(f"(line {line}): the ENGINE command does not parse: {e}") from None
    try:
        spec = EngineSpec(name, argv, model=str(model))
    except InvalidInputError as e:
        raise InvalidInputError(f"(line {line}): {e.message}") from None
    target = _file(Path(store_root), name)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump({"name": name, "argv": list(argv), "model": spec.model}, f)
    os.replace(tmp, target)
    return spec


def find_engine(store_root: str | os.PathLike, name: str) -> EngineSpec | None:
    """The ENGINE model ``name`` (a display name) created in this store, else None (a file
    that does not parse is ignored)."""
    p = _file(Path(store_root), name)
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            return None
        d = json.loads(p.read_text())
        return EngineSpec(str(d["name"]), tuple(str(w) for w in d["argv"]), model=str(d.get("model") or ""))
    except (OSError, ValueError, KeyError, TypeError, InvalidInputError):
        return None


def engine_files(store_root: str | os.PathLike) -> list[EngineSpec]:
    """Every ENGINE model of the store, sorted by name (at most 1,000)."""
    d = Path(store_root) / ENGINES_DIR
    out = []
    try:
        names = sorted(d.glob("*.json"))[:1000]
    except OSError:
        return []
    for p in names:
        try:
            name = json.loads(p.read_text())["name"] if p.stat().st_size <= MAX_FILE_BYTES else None
        except (OSError, ValueError, KeyError, TypeError):
            name = None
        spec = find_engine(store_root, name) if isinstance(name, str) else None
        if spec is not None:
            out.append(spec)
    return out


def engine_modified(store_root: str | os.PathLike, name: str) -> float | None:
    """When the ENGINE model ``name`` was created (its definition's mtime, Unix seconds), else None."""
    try:
        return _file(Path(store_root), name).stat().st_mtime
    except OSError:
        return None


def engine_modelfile(spec: EngineSpec) -> str:
    """The Modelfile ``show`` prints for an ENGINE model: ``FROM`` its model (when it has one) and
    the ``ENGINE`` line with values that look like keys written ``***``
    (:func:`~kvserve.supervisor.spec.shown_command`)."""
    lines = [f"FROM {spec.model}"] if spec.model else []
    return "\n".join([*lines, f"ENGINE {shown_command(spec.argv)}"]) + "\n"


def remove_engine(store_root: str | os.PathLike, name: str) -> bool:
    """Delete the ENGINE model ``name``; True when there was one."""
    try:
        _file(Path(store_root), name).unlink()
        return True
    except FileNotFoundError:
        return False
