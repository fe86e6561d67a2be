"""Command line: ``kvserve serve|run|pull|list|rm|bench``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n\nUsage: kvserve {serve,run,pull,list,rm,bench} ...")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from kvserve.serving.server import main as serve_main

        return serve_main(rest)
    print(f"kvserve: unknown command '{cmd}'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
