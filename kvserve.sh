#!/bin/sh
# kvserve in one command from a fresh clone (Python 3.11+ with venv, a C++ compiler for the native kernels):
#   ./kvserve.sh serve [kvserve serve flags]   set up .venv (once) and serve the default model
#   ./kvserve.sh test [pytest arguments]       set up .venv with the test extras (once), fetch the
#                                              default model from the package index, run the tests
# Anything else is passed to the kvserve command in the same environment (./kvserve.sh list ...).
# Commands run in the current directory (relative model paths are yours); the tests run in the clone.
# torch: TORCH_SPEC (default torch==2.13.0, the CPU build on the machines this project is tested on);
# on plain PyPI that version is the CUDA build (several GB): without a GPU set
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
set -eu
if [ $# -eq 0 ]; then
    echo "usage: ./kvserve.sh serve|test|<kvserve command> [arguments]" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")" && pwd)
venv="$repo/.venv"
extras=""
mark="$venv/.kvserve-setup"
if [ "$1" = "test" ]; then
    extras="[test]"
    mark="$venv/.kvserve-setup-test"
fi
if [ ! -f "$mark" ] || [ "$repo/pyproject.toml" -nt "$mark" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || {
        echo "kvserve.sh: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
    "$venv/bin/python" -m pip install -q --upgrade pip
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "$venv/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
    fi
    "$venv/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}" -e "$repo$extras"
    touch "$mark"
fi
if [ "$1" = "test" ]; then
    shift
    "$venv/bin/kvserve" pull smollm2 || echo "kvserve.sh: could not pull smollm2 (offline?): the tests that need it will fail" >&2
    cd "$repo"
    exec "$venv/bin/python" -m pytest "$@"
fi
exec "$venv/bin/kvserve" "$@"
