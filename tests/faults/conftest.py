"""Fixtures of the fault matrix: a results recorder that ``make faults`` prints as the matrix.

Every scenario test asks for ``matrix`` and records what it checked with
``matrix.record(committed=..., lost=..., corrupt_returned=..., typed=..., untyped=...)`` (counts
of steps committed before the fault, of those that could not be restored byte for byte, of
restores that returned a wrong byte, of errors that were / were not a typed tierckpt error);
``matrix.codes`` counts fuzzed status codes. Pass/fail comes from pytest. With
``TIERCKPT_FAULTS_RESULTS=FILE`` set, the rows are written to FILE (JSON) at the end of the
session; ``tests/faults/report.py FILE`` prints them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from .matrix import _ROWS, Matrix, _row


@pytest.fixture
def matrix(request: pytest.FixtureRequest) -> Matrix:
    return Matrix(_row(request.node))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    rep = outcome.get_result()
    row = _row(item)
    if rep.when == "setup" and rep.skipped:
        row["outcome"] = "skipped"
        row["reason"] = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    elif rep.when == "call":
        row["outcome"] = "skipped" if rep.skipped else rep.outcome
        if rep.skipped and isinstance(rep.longrepr, tuple):
            row["reason"] = str(rep.longrepr[2])
    elif rep.failed:
        row["outcome"] = "failed"


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("TIERCKPT_FAULTS_RESULTS")
    if out and _ROWS:
        rows = {k: v for k, v in _ROWS.items() if v["outcome"] != "not run"}
        with open(out, "w") as f:
            json.dump(sorted(rows.values(), key=lambda r: r["test"]), f, indent=1)

