"""The rows of the fault matrix (see conftest.py), shared by the fixtures and the hooks."""

from __future__ import annotations

import collections
from typing import Any

_ROWS: dict[str, dict[str, Any]] = {}


class Matrix:
    """The row of one test in the fault matrix."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    def record(self, **counts: int) -> None:
        for k, v in counts.items():
            self.row[k] = self.row.get(k, 0) + int(v)

    def code(self, name: str, n: int = 1) -> None:
        codes = self.row.setdefault("codes", {})
        codes[name] = codes.get(name, 0) + n

    @property
    def codes(self) -> collections.Counter:
        return collections.Counter(self.row.get("codes", {}))


def _row(item: Any) -> dict[str, Any]:
    return _ROWS.setdefault(item.nodeid, {"test": item.nodeid, "outcome": "not run"})
