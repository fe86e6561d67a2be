"""``kvserve serve`` parsing keeps its behaviour (issue #33 build 5: the flag table as the one source
of each flag's parsing and checks): every case of :mod:`args_cases` (each spelling of each flag,
bad and boundary values, every environment variable, precedence between flags and variables,
the rules that join flags) gives the exit status, output, error text and ServerArgs recorded in
``args_golden.json`` before the parser was rebuilt from the table.

A change of behaviour that is meant regenerates the file (``python tests/unit/args_cases.py >
tests/unit/args_golden.json``) and shows in its diff, one case a line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import args_cases  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "args_golden.json"


@pytest.fixture(scope="module")
def recorded():
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tmp():
    path = args_cases.make_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_cases_are_the_recorded_ones(recorded):
    """The case list and the recording agree (a new case needs a regenerated recording)."""
    assert [(r["argv"], r["env"]) for r in recorded[1:]] == [(a, e) for a, e in args_cases.cases()]
    assert len(recorded) == 3981


@pytest.mark.slow
def test_every_case_parses_as_recorded(recorded, tmp):
    base = recorded[0]["args"]
    assert args_cases.outcome([], {}, tmp, None) == recorded[0]
    bad = []
    for want in recorded[1:]:
        got = args_cases.outcome(want["argv"], want["env"], tmp, base)
        if got != want:
            bad.append((want, got))
    assert not bad, f"{len(bad)} cases differ; first: {json.dumps(bad[0], indent=1)[:3000]}"


def test_a_sample_of_cases_parses_as_recorded(recorded, tmp):
    """Every 25th case, in the fast suite."""
    base = recorded[0]["args"]
    for want in recorded[1::25]:
        assert args_cases.outcome(want["argv"], want["env"], tmp, base) == want
